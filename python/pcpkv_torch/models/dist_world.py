"""The whole-model PCP prefill with one process per rank (torchrun, torch.distributed): DistPcpWorld and
DistPcpModel.

    torchrun --nproc-per-node 4 -m pcpkv_torch.examples.prefill_dist --tokens 512

Each process owns one PCP rank: it computes that rank's rows of every attention layer (projections, dispatch,
indexer, sparse MLA) and holds that rank's cache replica in pcpkv symmetric memory (pcpkv_torch.distributed:
POSIX shared memory on the CPU, CUDA VMM memory on a GPU; every peer's replica is mapped here). Publication:
  direct   this rank's dispatch stores final cache bytes into every rank's replica (peer stores), fence
  staging  this rank's dispatch stores transport rows into its slot of every rank's staging workspace, fence,
           combine of every rank's rows into the own replica
  collect  this rank materializes its bf16 rows, torch.distributed all_gather, quantize-and-insert locally
The token-wise rest of the model (embedding, norms, MLP / MoE, lm_head) runs in global token order on every
process (replicated: each rank computes it the same way); the attention output rows are all-gathered from their
owners (torch.distributed). So the logits equal the single-process PcpModel's byte for byte.

The torch group's backend: gloo on the CPU and for several ranks sharing one GPU (NCCL refuses two ranks on one
GPU; CUDA rows then travel through host memory), NCCL with a GPU per rank. A rank that exits or is killed makes
every other rank raise RuntimeError naming it (a fence wait ends after fence_timeout_s, a collective when its
peer's connection closes or after the group's timeout).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from ..distributed import SymmetricCaches, _member_rank
from ..ops import rope_table
from ..rank_agreement import torch_gather
from . import agreement
from .replica_check import ReplicaCheck, compare_hashes, slot_hashes
from .world import PcpWorld

__all__ = ["DistPcpWorld", "DistPcpModel", "MAX_FENCE_TIMEOUT_S"]

MAX_FENCE_TIMEOUT_S = 86400.0  # one day


def _check_fence_timeout(fence_timeout_s) -> None:
    # The fence op takes whole microseconds: a bound under 1 us would reach it as 0 (refused there, at the first
    # layer, without this argument's name), inf would not convert; one day is mp-publish's bound too.
    if isinstance(fence_timeout_s, bool) or not isinstance(fence_timeout_s, (int, float)) or not (
            1e-6 <= fence_timeout_s <= MAX_FENCE_TIMEOUT_S):
        raise ValueError(f"fence_timeout_s = {fence_timeout_s!r} must be a number of seconds in [1e-06, "
                         f"{MAX_FENCE_TIMEOUT_S}] (1 us to one day)")


class DistPcpWorld(PcpWorld):
    """PcpWorld's interface for this process's rank of a torch.distributed group (collective to build): mla /
    index [layer][r] are every rank's replicas as mapped here (symmetric memory; replica_bytes(layer, r) reads any
    rank's), local_ranks = [rank]. pcp_world must equal the group's size. timeout_s bounds pcpkv's bootstrap steps,
    fence_timeout_s (seconds, 1e-6 to 86400) every fence wait. check_replicas: see replica_check.py (the hashes are all-gathered).
    Raises RuntimeError when torch.distributed is not initialized or setup fails on any rank (naming it),
    ValueError for a pcp_world other than the group's size or a fence_timeout_s out of range. close() releases the symmetric memory."""

    def __init__(self, spec, pcp_world: int, num_layers: int, num_blocks: int, block_size: int, *,
                 kv_format: str = "fp8_ds_mla", ds_mla_scale: str = "pow2", max_positions: int, device=None,
                 fill: int = 0xA5, check_replicas: Optional[bool] = None, group=None, timeout_s: float = 60.0,
                 fence_timeout_s: float = 30.0):
        import torch.distributed as dist

        _check_fence_timeout(fence_timeout_s)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistPcpWorld: torch.distributed is not initialized (run under torchrun and call "
                               "torch.distributed.init_process_group)")
        W = dist.get_world_size(group)
        if pcp_world != W:
            raise ValueError(f"pcp_world = {pcp_world}, but the torch.distributed group has {W} ranks (one per rank)")
        self._closed = False
        self.group, self.W, self.spec, self.num_layers = group, W, spec, num_layers
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.replica_check = ReplicaCheck(check_replicas)
        self.caches = SymmetricCaches(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                                      kv_format=kv_format, ds_mla_scale=ds_mla_scale,
                                      has_indexer=[spec.layer_has_indexer(i) for i in range(num_layers)],
                                      device=self.device, group=group, timeout_s=timeout_s, fill=fill)
        self.device = self.caches.device  # cuda -> cuda:<current>
        self.rank = self.caches.rank
        self.local_ranks = [self.rank]
        self.fmts, self.mla, self.index = self.caches.fmts, self.caches.mla, self.caches.index
        self.targets, self.pads, self.fence_state = self.caches.targets, self.caches.pads, self.caches.fence_state
        self.rope = rope_table(spec.rope, max_positions, self.device)
        self.max_positions = max_positions
        self.fence_timeout_us = int(fence_timeout_s * 1e6)
        self._gloo = dist.get_backend(group) == "gloo"
        self._agree_gather = torch_gather(group, "DistPcpModel.step agreement")

    # ---- what differs from W ranks in one process ------------------------------------------------------------

    def _staging_for(self, fmt, rows: int):
        ws, dests = self.caches.staging_for(fmt, rows)
        per_rank = [[d if r == self.rank else None for r in range(self.W)] for d in dests]
        return ws[0].shape[3], ws, per_rank

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[W, *t.shape]: every rank's t (same shape and dtype on every rank), bytes exactly (any dtype)."""
        import torch.distributed as dist

        src = t.contiguous().reshape(-1).view(torch.uint8)
        if self._gloo and src.is_cuda:
            src = src.cpu()  # gloo gathers host memory
        outs = [torch.empty_like(src) for _ in range(self.W)]
        dist.all_gather(outs, src, group=self.group)
        return torch.stack(outs).to(t.device).view(t.dtype).view(self.W, *t.shape)

    def agree_step(self, requests, transport, blocks):
        """Compares this step's requests (ids, token ids, context_len, decode), the transport override, the cache
        state (agreement.step_entries) and the fence epochs with every rank's by a digest before any work:
        Disagreement (ValueError) on every rank naming the first differing request and field and the ranks'
        values."""
        def entries():
            # raised here, inside the exchange, so that a peer which did not close is told too (a step after
            # world.close() ran into the released caches: IndexError)
            self._check_open("DistPcpModel.step")
            # the fence epochs too: a step that failed on one rank before a fence leaves the ranks' epochs apart,
            # and a fence passed on a stale epoch would read rows a peer has not written yet
            epochs = () if self.fence_state is None else tuple(self.fence_state.epochs.reshape(-1).tolist())
            why = "apart after a step failed on some ranks only: build a new DistPcpModel"
            return agreement.step_entries(requests, transport, blocks) + [
                (f"fence epochs ({why})", epochs), (f"staging calls ({why})", self._staging_calls)]

        self._named("the step agreement", lambda: agreement.check(self._agree_gather, "DistPcpModel.step", entries))

    def _gather_rows(self, rows: Sequence[torch.Tensor]):
        for t in rows:
            t.copy_(self.all_gather(t[self.rank]))

    def _named(self, what: str, fn):
        """fn(); a failure while a peer process is gone is re-raised naming that rank."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - re-raised, with the dead rank named when there is one
            boot = self.caches.bootstrap
            dead = boot.dead_ranks() if boot is not None else []
            if not dead:
                raise
            who = ", ".join(f"rank {r} (pid {boot.pids[r]})" for r in dead)
            raise RuntimeError(f"{what} on rank {self.rank}: {who} exited or was killed ({e})") from e

    def publish(self, layer_idx, transport, local, step, weights, q_c_out):
        self._check_open("DistPcpWorld.publish")

        def run():
            super(DistPcpWorld, self).publish(layer_idx, transport, local, step, weights, q_c_out)
            if self.device.type == "cuda":  # the device fence reports a timeout in memory; raise it here
                torch.cuda.synchronize(self.device)
                self.fence_state.check()

        self._named(f"layer {layer_idx} publication ({transport})", run)

    def owned_to_global(self, ys: dict, step, like: torch.Tensor,
                        failure: Optional[Exception] = None) -> torch.Tensor:
        """Every rank reaches this all-gather, failed or not (a rank that raised before it left its peers inside it,
        and its retry's first exchange paired with theirs: gloo aborted it). Each rank's rows carry one more
        element, its verdict; when a rank failed, every rank raises RuntimeError naming it and its error, the
        collectives in step, so the step can be retried."""
        if failure is None:
            mine = ys[self.rank].contiguous().reshape(-1).view(torch.uint8)
        else:  # rows of the size every rank sends, never read
            mine = torch.zeros(step.max_local_tokens * like[0].numel() * like.element_size(), dtype=torch.uint8,
                               device=like.device)
        k = like.element_size()  # the verdict takes one element: every rank's rows stay aligned for like's dtype
        flag = torch.full((k,), failure is not None, dtype=torch.uint8, device=mine.device)
        g = self._named("the attention output all-gather", lambda: self.all_gather(torch.cat([mine, flag])))
        failed = [r for r in range(self.W) if int(g[r, -1])]
        if failed:
            why = f"{type(failure).__name__}: {failure}" if failure is not None else ""
            share = torch_gather(self.group, "DistPcpModel.step")
            whys = self._named("sharing the step's failure", lambda: share(why))
            raise RuntimeError("DistPcpModel.step failed between the fence and the attention all-gather, on " +
                               "; ".join(f"rank {r}: {whys[r]}" for r in failed) +
                               " (every rank rolled the step back; it can be retried)") from failure
        g = g[:, :-k].view(like.dtype).view(self.W, -1, *like.shape[1:])
        out = torch.zeros_like(like)
        for r in range(self.W):
            step.scatter_owned(out, g[r], r)
        return out

    def check_published(self, layer_idx: int, step):
        if not self.replica_check.enabled:
            return
        t0 = time.perf_counter()
        slots, islots = self.replica_check.written(step)
        idx = self.index[layer_idx]
        mine = slot_hashes(self.mla[layer_idx][self.rank], idx[self.rank] if idx is not None else None, slots, islots)
        hashes = self._named(f"layer {layer_idx} replica check", lambda: self.all_gather(mine))
        compare_hashes(hashes, slots, layer_idx, islots)
        self.replica_check.record(t0)

    def close(self):
        """Releases this rank's symmetric memory and bootstrap (local; the peers need not be alive). Twice is fine;
        a step or replica read afterwards raises RuntimeError '... used after world.close()'."""
        self._closed = True
        self.mla, self.index, self.targets, self.pads, self.fence_state = [], [], [], [], None
        self.caches.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} used after world.close() (its symmetric memory is released; build a new "
                               "DistPcpModel)")

    def replica_bytes(self, layer_idx: int, rank: int):
        self._check_open("DistPcpWorld.replica_bytes")
        return super().replica_bytes(layer_idx, rank)


#: PcpModel arguments that only observe this rank's run (no collective, cache byte or logit depends on them): not
#: compared across ranks.
_LOCAL_ONLY = ("hf_model", "make_world", "timing", "record_topk", "poison")


def _setup_entries(hf_model, bound: dict, world_args: dict) -> list:
    """What the ranks of a DistPcpModel must share: PcpModel's arguments (seed, num_blocks, block_size, kv_format,
    transport, ...; max_positions and check_replicas as resolved), the model's type, config, dtype and device
    kind, and its weights (agreement.module_digest of the state dict)."""
    import json

    cfg = hf_model.config
    out = [(k, v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
           for k, v in sorted(bound.items()) if k not in _LOCAL_ONLY]
    out += [("max_positions (resolved)", world_args["max_positions"]),
            ("check_replicas (resolved)", ReplicaCheck(world_args["check_replicas"]).enabled),
            ("hf_model.config", agreement.digest([("json", json.dumps(cfg.to_dict(), sort_keys=True, default=str))])),
            ("hf_model dtype", str(next(hf_model.parameters()).dtype)),
            ("hf_model device type", next(hf_model.parameters()).device.type),
            ("hf_model weights (state dict digest)", agreement.module_digest(hf_model))]
    return out


def DistPcpModel(hf_model, *, group=None, timeout_s: float = 60.0, fence_timeout_s: float = 30.0, **kw):
    """A PcpModel (same arguments but pcp_world, which is the group's size) with one PCP rank per process of the
    torch.distributed group (DistPcpWorld). Collective: every rank builds it with the same arguments and model
    weights, and calls step() with the same requests.

    Every rank agrees or every rank refuses: before the symmetric caches are set up, the ranks compare by a digest
    their arguments (seed, num_blocks, block_size, kv_format, transport, row_chunk, the plan modes, max_positions,
    check_replicas; not timing / record_topk / poison), the model's config, dtype and device kind and a digest of
    its state dict (the weights, hashed where they live); each step() compares its requests (ids, token ids,
    context_len, decode), transport, the cache state and the fence epochs first (agreement.py). A mismatch raises
    ValueError (agreement.Disagreement) on every rank naming the first differing field (and request) and each
    rank's value; an argument one rank refuses raises there as it would alone and on every other rank naming that
    rank and the message. Release its memory with model.world.close()."""
    import inspect

    import torch.distributed as dist

    from .runner import PcpModel

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("DistPcpModel: torch.distributed is not initialized (run under torchrun and call "
                           "torch.distributed.init_process_group)")
    _member_rank(group, "DistPcpModel")  # group=5 was an AttributeError from dist.get_world_size
    W = dist.get_world_size(group)
    gather = torch_gather(group, "DistPcpModel setup agreement")
    shared = {"done": False}

    def agree(entries):
        shared["done"] = True  # every rank makes exactly one setup exchange, with its entries or its failure
        agreement.check(gather, "DistPcpModel setup", entries)

    def make_world(*args, **kwargs):
        def entries():
            bound = inspect.signature(PcpModel).bind(hf_model, W, **kw)
            bound.apply_defaults()
            return _setup_entries(hf_model, dict(bound.arguments), kwargs)

        # Checked before the exchange, so that a refusal is shared: checked only in DistPcpWorld, after it, one
        # rank's fence_timeout_s = 0 raised there alone while its peers waited in the caches' setup, then paired
        # their exchange with that rank's next one (garbled messages, every later collective off by one).
        _check_fence_timeout(fence_timeout_s)
        agree(entries)
        return DistPcpWorld(*args, group=group, timeout_s=timeout_s, fence_timeout_s=fence_timeout_s, **kwargs)

    try:
        return PcpModel(hf_model, W, make_world=make_world, **kw)
    except Exception as e:
        if not shared["done"]:  # refused here before the exchange: the peers wait in it, so tell them

            def failed():
                raise e

            agree(failed)
        raise
