"""W logical PCP ranks in one process (one GPU, or the CPU): every rank's cache replicas of every layer, its
staging workspace and the shared fence, and one layer's publication with each transport (SPEC section 5).

  collect  every rank materializes bf16 kv_c / k_pe / index_k of its rows (dispatch), the rows are all-gathered
           (a concatenation here, NCCL across processes), every rank quantizes and inserts all rows (insert)
  staging  every rank's dispatch stores packed transport rows into its slot of every rank's staging workspace,
           fence, every rank scatters the rows of all ranks into its own replica (combine)
  direct   every rank's dispatch stores final cache bytes into every replica, fence
Every path leaves every replica byte-identical; staging and direct leave identical bytes (collect quantizes
from bf16-rounded values, so its bytes are its own: SPEC section 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..layout import allocate_indexer_cache, allocate_mla_cache, allocate_staging
from ..model import CacheFormat, ModelSpec
from ..ops import combine, dispatch, fence, insert, rope_table
from ..tables import CacheTargets, FenceState, RowDests, allocate_fence_pads
from ..transport import TRANSPORTS, one_process_topology, resolve_transport
from .replica_check import ReplicaCheck

__all__ = ["TRANSPORTS", "LocalInputs", "PcpWorld"]


@dataclass
class LocalInputs:
    """One rank's dispatch inputs of a layer (M local rows, padding included): q_c bf16 [M, q_lora_rank] (q_a_proj
    output), kv bf16 [M, 512], k_pe bf16 [M, 64] (kv_a_proj_with_mqa output split), index_k bf16 [M, 128] (indexer
    wk output; None on a layer without an indexer)."""

    q_c: torch.Tensor
    kv: torch.Tensor
    k_pe: torch.Tensor
    index_k: Optional[torch.Tensor]


class PcpWorld:
    """Caches of W logical ranks for num_layers layers: mla[layer][rank] uint8 [num_blocks, block_size, row_bytes],
    index[layer][rank] uint8 [num_blocks, block_size, 132] (None on layers without an indexer), allocated once
    and filled with `fill` (guard pattern) so untouched bytes are recognizable. Norm weights come per call.
    check_replicas: see replica_check.py (None: the PCPKV_CHECK_REPLICAS environment variable decides)."""

    fence_timeout_us = 10_000_000  # bound of a fence wait (a missing rank is named past it)

    _staging_calls = 0  # staging publications so far: picks the workspace buffer (every rank makes the same calls)

    def __init__(self, spec: ModelSpec, pcp_world: int, num_layers: int, num_blocks: int, block_size: int, *,
                 kv_format: str = "fp8_ds_mla", ds_mla_scale: str = "pow2", max_positions: int, device=None,
                 fill: int = 0xA5, check_replicas: Optional[bool] = None):
        if pcp_world < 1:
            raise ValueError(f"pcp_world = {pcp_world} must be >= 1")
        self.spec, self.W, self.num_layers = spec, pcp_world, num_layers
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.fmts = [CacheFormat(kv_format, ds_mla_scale, has_indexer=spec.layer_has_indexer(i))
                     for i in range(num_layers)]
        self.mla = [[allocate_mla_cache(num_blocks, block_size, kv_format, self.device, fill=fill)
                     for _ in range(pcp_world)] for _ in range(num_layers)]
        self.index = [[allocate_indexer_cache(num_blocks, block_size, self.device, fill=fill)
                       for _ in range(pcp_world)] if self.fmts[i].has_indexer else None for i in range(num_layers)]
        self.targets = [CacheTargets.from_caches(self.mla[i], self.index[i], self.fmts[i]) for i in range(num_layers)]
        self.rope = rope_table(spec.rope, max_positions, self.device)
        self.max_positions = max_positions
        self.pads = allocate_fence_pads(pcp_world, num_barriers=1, device=self.device)
        self.fence_state = FenceState.local(self.pads, num_barriers=1)
        self._staging: dict = {}   # row_bytes -> (capacity M, [W] workspaces, [W] RowDests per buffer)
        self.local_ranks = range(pcp_world)  # the ranks this process computes: all of them
        self.replica_check = ReplicaCheck(check_replicas)

    def resolve_transport(self, transport: str) -> tuple[str, str]:
        """(transport, reason) for a name of TRANSPORTS or "auto" (pcpkv_torch.transport.resolve_transport over
        this world's topology: one host, every rank's replica reachable by every rank; true for W logical ranks
        in one process and for DistPcpWorld, whose setup maps every peer or fails and refuses a group spanning
        hosts); ValueError for another name."""
        return resolve_transport(transport, one_process_topology(self.W))

    def _staging_for(self, fmt: CacheFormat, rows: int):
        have = self._staging.get(fmt.row_bytes)
        if have is None or have[0] < rows:
            ws = [allocate_staging(self.W, rows, fmt, self.device, fill=0) for _ in range(self.W)]
            dests = [[RowDests.from_staging(ws, r, buffer=b) for r in range(self.W)] for b in range(2)]
            have = (rows, ws, dests)
            self._staging[fmt.row_bytes] = have
        return have

    def publish(self, layer_idx: int, transport: str, local: Sequence[LocalInputs], step, weights: dict,
                q_c_out: Sequence[torch.Tensor]):
        """Publishes layer layer_idx's rows of every rank of local_ranks into every replica with `transport` and
        writes each such rank's normalized q_c (RMSNorm, SPEC section 2.1) into q_c_out[r] bf16 [M, q_lora_rank].
        step: the StepBatch (positions, slot mappings); weights: q_norm_w, kv_norm_w, index_ln_w, index_ln_b.
        transport "auto": resolve_transport() (direct here: the W ranks share one process and device).
        Raises ValueError for an unknown transport or positions past the RoPE table."""
        transport, _ = self.resolve_transport(transport)
        if step.max_position >= self.max_positions:
            raise ValueError(f"position {step.max_position} is past the RoPE table of max_positions = "
                             f"{self.max_positions}")
        fmt = self.fmts[layer_idx]
        mla, index = self.mla[layer_idx], self.index[layer_idx]
        kw = self.spec.dispatch_kwargs()

        def run(r, **where):
            x = local[r]
            dispatch(x.kv, x.k_pe, step.positions[r], weights["kv_norm_w"], self.rope, fmt=fmt, q_c=x.q_c,
                     q_norm_w=weights["q_norm_w"], q_c_out=q_c_out[r],
                     index_k=x.index_k if fmt.has_indexer else None,
                     index_ln_w=weights.get("index_ln_w") if fmt.has_indexer else None,
                     index_ln_b=weights.get("index_ln_b") if fmt.has_indexer else None, **where, **kw)

        M = step.max_local_tokens
        if transport == "direct":
            for r in self.local_ranks:
                run(r, slot_mapping=step.slot_mapping[r], targets=self.targets[layer_idx])
            fence(self.fence_state, 0, timeout_us=self.fence_timeout_us, written=mla + (index or []))
        elif transport == "staging":
            _, ws, dests = self._staging_for(fmt, M)
            # alternate buffers per call, not by layer parity: a rank may run one layer ahead of a peer's combine,
            # and with an odd layer count the last layer and the next step's first would share buffer 0
            buf, self._staging_calls = self._staging_calls % 2, self._staging_calls + 1
            for r in self.local_ranks:
                run(r, slot_mapping=step.slot_mapping[r], row_dests=dests[buf][r])
            fence(self.fence_state, 0, timeout_us=self.fence_timeout_us, written=ws)
            cap = ws[0].shape[3]
            gathered = step.gathered_slot_mapping
            if cap != M:  # a workspace sized for a longer step: rows past M of every slot are skipped
                gathered = torch.full((self.W, cap), -1, dtype=torch.int64, device=self.device)
                gathered[:, :M] = step.slot_mapping
                gathered = gathered.view(-1)
            for r in self.local_ranks:
                combine(ws[r][buf, 0], gathered, mla[r], index[r] if fmt.has_indexer else None, fmt=fmt)
        else:
            kv_c = torch.empty((self.W, M, 512), dtype=torch.bfloat16, device=self.device)
            k_pe = torch.empty((self.W, M, 64), dtype=torch.bfloat16, device=self.device)
            idx_k = torch.empty((self.W, M, 128), dtype=torch.bfloat16, device=self.device) if fmt.has_indexer else None
            for r in self.local_ranks:
                run(r, kv_c_out=kv_c[r], k_pe_out=k_pe[r], index_k_out=idx_k[r] if idx_k is not None else None)
            self._gather_rows([kv_c, k_pe] + ([idx_k] if idx_k is not None else []))
            # the all-gather: rank-major rows, the order of gathered_slot_mapping
            kv_c, k_pe = kv_c.view(-1, 512), k_pe.view(-1, 64)
            idx_k = idx_k.view(-1, 128) if idx_k is not None else None
            for r in self.local_ranks:
                insert(kv_c, k_pe, idx_k, step.gathered_slot_mapping, mla[r], index[r] if fmt.has_indexer else None,
                       fmt=fmt)

    def agree_step(self, requests, transport, blocks):
        """Every rank runs the same step (DistPcpWorld compares them across processes); here the ranks share it."""

    def _gather_rows(self, rows: Sequence[torch.Tensor]):
        """collect's all-gather of rows [W, M, ...] (rank r's rows at [r]): here every rank wrote its own already."""

    def check_published(self, layer_idx: int, step):
        """The run-time replica check of a published layer (check_replicas=True or PCPKV_CHECK_REPLICAS=1):
        RuntimeError naming the layer, the ranks and the first differing slot when the replicas disagree."""
        if self.replica_check.enabled:
            self.replica_check.check_local(self, layer_idx, step)

    def owned_to_global(self, ys: dict, step, like: torch.Tensor, failure: Optional[Exception] = None) -> torch.Tensor:
        """[N, ...] in global order from every rank's rows ys[r] [M, ...] (each token from its owner). failure: the
        exception that kept this process from computing ys (raised here; DistPcpWorld raises it on every rank)."""
        if failure is not None:
            raise failure
        out = torch.zeros_like(like)
        for r, y in ys.items():
            step.scatter_owned(out, y, r)
        return out

    def replica_bytes(self, layer_idx: int, rank: int):
        """(MLA, indexer or None) cache bytes of one replica, on the CPU (for byte comparisons)."""
        idx = self.index[layer_idx]
        return (self.mla[layer_idx][rank].cpu().clone(),
                idx[rank].cpu().clone() if idx is not None else None)
