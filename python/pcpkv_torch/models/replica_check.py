"""The run-time replica check (debug mode, off by default): after a layer's publication every rank hashes the rows
of the slots written in that layer in its own replica (MLA row and indexer row), the ranks compare the hashes (one
small exchange: an all-gather of int64 [slots] across processes), and a mismatch raises RuntimeError naming the
layer, the ranks and the first differing slot. Silent replica divergence (a lost peer store, a stale row) is then
seen at the layer where it happens instead of as wrong tokens later.

Enable it with check_replicas=True (PcpModel, PcpWorld, DistPcpWorld) or PCPKV_CHECK_REPLICAS=1 (when the
argument is left at None; 0 or empty leaves it off, any other value raises ValueError, as in the C++ library). The hash is a weighted byte sum mod 2^64 with odd weights: a change of any one byte
always changes it. It is the C++ library's hash (docs/spec.md section 5.2; the weights, splitmix64's outputs made odd,
come from pcpkv/device/replica_hash.h through torch.ops.pcpkv.replica_hash_weights), so a slot hashes to the same value here, in `pcpkv run --check-replicas`
and on the GPU (python/tests/test_replica_check.py checks the fixed values the C++ tests check).
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


def slot_hashes(mla: torch.Tensor, index: Optional[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """int64 [n]: a hash of each slot's bytes (MLA row, and with an indexer cache its 128 e4m3 bytes and fp32
    scale) in mla uint8 [num_blocks, block_size, row_bytes] / index uint8 [num_blocks, block_size, 132], slots
    int64 [n] in [0, num_blocks * block_size)."""
    nb, bs, row = mla.shape
    parts = [mla.reshape(nb * bs, row).index_select(0, slots)]
    if index is not None:
        data, scales = indexer_cache_view(index)
        parts.append(data.reshape(nb * bs, 128).contiguous().view(torch.uint8).index_select(0, slots))
        parts.append(scales.reshape(nb * bs, 1).contiguous().view(torch.uint8).index_select(0, slots))
    rows = torch.cat(parts, dim=1).to(torch.int64)
    return (rows * _weights(rows.shape[1], rows.device)).sum(dim=1)  # int64 sums wrap: mod 2^64


def compare_hashes(hashes: torch.Tensor, slots: torch.Tensor, layer_idx: int):
    """hashes int64 [W, n] (rank r's hashes of slots int64 [n]); raises RuntimeError naming the layer, the ranks
    whose replica differs from rank 0's at the first differing slot, and how many slots differ."""
    diff = (hashes != hashes[:1]).cpu()
    if not bool(diff.any()):
        return
    cols = diff.any(dim=0).nonzero().flatten()
    j = int(cols[0])
    bad = diff[:, j].nonzero().flatten().tolist()
    slot = int(slots.cpu()[j])
    raise RuntimeError(f"replica check: layer {layer_idx}: rank{'s' if len(bad) > 1 else ''} "
                       f"{', '.join(map(str, bad))} {'differ' if len(bad) > 1 else 'differs'} from rank 0 at slot "
                       f"{slot} (first of {cols.numel()} differing slots of the {hashes.shape[1]} written in this "
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
    def written_slots(step) -> torch.Tensor:
        s = step.gathered_slot_mapping
        return s[s >= 0]

    def check_local(self, world, layer_idx: int, step):
        """Every replica of a world whose ranks all live in this process (PcpWorld)."""
        t0 = time.perf_counter()
        slots = self.written_slots(step)
        idx = world.index[layer_idx]
        h = torch.stack([slot_hashes(world.mla[layer_idx][r], idx[r] if idx is not None else None, slots)
                         for r in range(world.W)])
        compare_hashes(h, slots, layer_idx)
        self.record(t0)
