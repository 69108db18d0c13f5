"""The run-time replica check (debug mode, off by default): after a layer's publication every rank hashes the rows
of the slots written in that layer in its own replica (MLA row and indexer row), the ranks compare the hashes (one
small exchange: an all-gather of int64 [slots] across processes), and a mismatch raises RuntimeError naming the
layer, the ranks and the first differing slot. Silent replica divergence (a lost peer store, a stale row) is then
seen at the layer where it happens instead of as wrong tokens later.

Enable it with check_replicas=True (PcpModel, PcpWorld, DistPcpWorld) or PCPKV_CHECK_REPLICAS=1 (when the argument
is left at None; 0 or empty leaves it off, any other value raises ValueError, as in the C++ library). The hash is a
weighted byte sum mod 2^64 with odd weights: a change of any one byte always changes it. It is the C++ library's
hash (docs/spec.md section 5.2; the weights, splitmix64's outputs made odd, come from pcpkv/device/replica_hash.h
through torch.ops.pcpkv.replica_hash_weights), so a slot hashes to the same value here, in `pcpkv run
--check-replicas` and on the GPU (python/tests/test_replica_check.py checks the fixed values the C++ tests check). A
step whose indexer rows go to their own slots (a gathered_indexer_slot_mapping, docs/spec.md 4.2) hashes each
written row's indexer bytes at its indexer slot (spec 5.2; the padding of a padded indexer block stride is never
read).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from ..layout import indexer_cache_view

__all__ = ["ENV", "ReplicaCheck", "enabled_from_env", "slot_hashes", "compare_hashes"]

ENV = "PCPKV_CHECK_REPLICAS"
_WEIGHTS: dict = {}


def _weights(n: int, device) -> torch.Tensor:
    """int64 [n]: w(0..n) of docs/spec.md 5.2 as two's-complement int64 (the int64 products and sums then wrap like
    uint64 mod 2^64), from the C++ library's one definition (pcpkv/device/replica_hash.h)."""
    key = (n, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        w = torch.ops.pcpkv.replica_hash_weights(n).to(device)
        _WEIGHTS[key] = w
    return w


def _check_slots(name: str, s: torch.Tensor, n: int, num_slots: int) -> None:
    """ValueError naming name[i] and its value for the first entry neither -1 nor in [0, num_slots)."""
    if s.dtype != torch.int64 or s.dim() != 1 or s.numel() != n:
        raise ValueError(f"{name}: expected int64 [{n}], got {s.dtype} {list(s.shape)}")
    bad = ((s < -1) | (s >= num_slots)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {int(s[i])} is outside [0, {num_slots}) (the cache's slots; -1: none)")


def _own_slot_hashes(mla: torch.Tensor, index: Optional[torch.Tensor], slots: torch.Tensor,
                     index_slots: torch.Tensor) -> torch.Tensor:
    """slot_hashes with the indexer at its own slots: the MLA row at slots[i], the indexer row at index_slots[i],
    -1 in either adding nothing; the weights are the one-slot form's (the sums are exact mod 2^64, so the two parts
    add up to the one-slot hash where index_slots == slots)."""
    nb, bs, row = mla.shape
    n = slots.numel()
    _check_slots("slots", slots, n, nb * bs)
    w = _weights(row + (132 if index is not None else 0), mla.device)

    def part(flat: torch.Tensor, s: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        keep = (s >= 0).to(torch.int64).unsqueeze(1)
        rows = flat.index_select(0, s.clamp(min=0)).to(torch.int64) * keep
        return (rows * weights).sum(dim=1)

    h = part(mla.reshape(nb * bs, row), slots, w[:row])
    if index is not None:
        inb = index.shape[0]
        _check_slots("index_slots", index_slots, n, inb * bs)
        data, scales = indexer_cache_view(index)  # the rows and scales only: never a padded block's padding
        flat = torch.cat([data.reshape(inb * bs, 128).contiguous().view(torch.uint8),
                          scales.reshape(inb * bs, 1).contiguous().view(torch.uint8)], dim=1)
        h = h + part(flat, index_slots, w[row:])
    return h


def slot_hashes(mla: torch.Tensor, index: Optional[torch.Tensor], slots: torch.Tensor,
                index_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [n]: a hash of each slot's bytes (MLA row, and with an indexer cache its 128 e4m3 bytes and fp32
    scale) in mla uint8 [num_blocks, block_size, row_bytes] / index uint8 [num_blocks, block_size, 132], slots
    int64 [n] in [0, num_blocks * block_size). index_slots int64 [n] (docs/spec.md 4.2 and 5.2: the indexer cache
    at its own slots, of its own num_blocks, a padded block stride allowed): entry i hashes its MLA row at slots[i]
    and its indexer row at index_slots[i], -1 in either meaning no row of that cache; ValueError naming the entry
    for a slot outside its cache. index_slots equal to slots gives the hashes without it."""
    if index_slots is not None:
        return _own_slot_hashes(mla, index, slots, index_slots)
    nb, bs, row = mla.shape
    parts = [mla.reshape(nb * bs, row).index_select(0, slots)]
    if index is not None:
        data, scales = indexer_cache_view(index)
        parts.append(data.reshape(nb * bs, 128).contiguous().view(torch.uint8).index_select(0, slots))
        parts.append(scales.reshape(nb * bs, 1).contiguous().view(torch.uint8).index_select(0, slots))
    rows = torch.cat(parts, dim=1).to(torch.int64)
    return (rows * _weights(rows.shape[1], rows.device)).sum(dim=1)  # int64 sums wrap: mod 2^64


def compare_hashes(hashes: torch.Tensor, slots: torch.Tensor, layer_idx: int,
                   index_slots: Optional[torch.Tensor] = None):
    """hashes int64 [W, n] (rank r's hashes of slots int64 [n]); raises RuntimeError naming the layer, the ranks
    whose replica differs from rank 0's at the first differing slot (and its indexer slot, index_slots int64 [n]
    given), and how many slots differ."""
    diff = (hashes != hashes[:1]).cpu()
    if not bool(diff.any()):
        return
    cols = diff.any(dim=0).nonzero().flatten()
    j = int(cols[0])
    bad = diff[:, j].nonzero().flatten().tolist()
    slot = int(slots.cpu()[j])
    at = f"slot {slot}"
    if index_slots is not None:  # the words of the C++ check (replica_hash_check)
        islot = int(index_slots.cpu()[j])
        at = (f"indexer slot {islot} (no MLA row)" if slot < 0 else f"slot {slot} (no indexer row)" if islot < 0
              else f"slot {slot} (indexer slot {islot})")
    raise RuntimeError(f"replica check: layer {layer_idx}: rank{'s' if len(bad) > 1 else ''} "
                       f"{', '.join(map(str, bad))} {'differ' if len(bad) > 1 else 'differs'} from rank 0 at {at} "
                       f"(first of {cols.numel()} differing slots of the {hashes.shape[1]} written in this "
                       f"layer; replicas diverged)")


def enabled_from_env() -> bool:
    """PCPKV_CHECK_REPLICAS as the C++ library reads it (pcpkv::replica_check_from_env): "1" on; "0", empty or
    unset off; any other value raises ValueError naming the variable and the value (a "yes" or "true" that
    silently left the check off would hide exactly the divergence it was set to catch)."""
    v = os.environ.get(ENV, "")
    if v not in ("", "0", "1"):
        raise ValueError(f"{ENV}: must be 1 (on) or 0 / empty / unset (off), got {v[:200]!r}"
                         + (f" ({len(v)} characters)" if len(v) > 200 else ""))
    return v == "1"


class ReplicaCheck:
    """enabled: the argument, or PCPKV_CHECK_REPLICAS (enabled_from_env) when it is None."""

    def __init__(self, enabled: Optional[bool] = None):
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"check_replicas = {enabled!r} must be True, False or None")
        self.enabled = enabled_from_env() if enabled is None else enabled
        self.seconds, self.layers = 0.0, 0  # its cost: wall time of every check (it synchronizes), layers checked

    def record(self, t0: float):
        self.seconds += time.perf_counter() - t0
        self.layers += 1

    @staticmethod
    def written(step):
        """(slots, index_slots or None): the gathered rows a step writes, rank-major, their MLA slots and, when the
        step has a gathered_indexer_slot_mapping (the indexer at its own slots, docs/spec.md 4.2), their indexer
        slots; a row is written where either mapping is >= 0."""
        s = step.gathered_slot_mapping
        i = getattr(step, "gathered_indexer_slot_mapping", None)
        if i is None:
            return s[s >= 0], None
        keep = (s >= 0) | (i >= 0)
        return s[keep], i[keep]

    @staticmethod
    def written_slots(step) -> torch.Tensor:
        return ReplicaCheck.written(step)[0]

    @staticmethod
    def written_index_slots(step) -> Optional[torch.Tensor]:
        return ReplicaCheck.written(step)[1]

    def check_local(self, world, layer_idx: int, step):
        """Every replica of a world whose ranks all live in this process (PcpWorld)."""
        t0 = time.perf_counter()
        slots, islots = self.written(step)
        idx = world.index[layer_idx]
        h = torch.stack([slot_hashes(world.mla[layer_idx][r], idx[r] if idx is not None else None, slots, islots)
                         for r in range(world.W)])
        compare_hashes(h, slots, layer_idx, islots)
        self.record(t0)
