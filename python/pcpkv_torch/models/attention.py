"""The PCP attention that replaces each HF decoder layer's self_attn (GlmMoeDsaAttention / DeepseekV32Attention).

Per layer, with hidden states in global token order [1, N, hidden] (what the HF decoder layer hands over) and
per rank r its local rows (the step's PCP plan):
  1. projections on r's rows: q_a_proj, kv_a_proj_with_mqa (split kv 512 | k_pe 64), indexer wk, weights_proj
  2. publication: pcpkv dispatch (q RMSNorm, kv RMSNorm + RoPE, indexer LayerNorm + RoPE, FP8) of every rank
     into every replica with the chosen transport, fence (world.PcpWorld.publish)
  3. on r's own replica: the sparse indexer (index q = wq_b(q_c_out), RoPE, UE8M0 FP8) -> top-k slots, or the
     previous indexer layer's top-k on a GLM IndexShare "shared" layer; sparse MLA with W_UK absorbed into q
     (q [M, H, 576] = [q_nope W_UK | q_pe]), then W_UV and o_proj
  4. the rows r owns go back to global order.
Token-wise projections run in fixed chunks of `row_chunk` rows, so a row's result does not depend on how many
rows its rank holds (a GEMM's blocking changes with the batch; the same shape computes a row the same way
wherever it sits), which is what makes PCP-P logits bit-identical to P = 1. row_chunk=None runs them whole.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ..consumers import indexer_topk, quantize_index_q, sparse_mla
from .world import LocalInputs

__all__ = ["apply_rope", "chunked", "PcpRuntime", "PcpAttention"]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE of the last dim (64) of x [M, ..., 64] at positions int64 [M] with pcpkv's table float32
    [num_positions, 64] = [cos 32 | sin 32] (SPEC sections 1 and 2.3), fp32 math, rounded once to x's dtype.
    interleaved: pairs (2i, 2i+1) rotated in place (the layout of the cache's k_pe); else NeoX pairs (i, i+32)."""
    cs = table.index_select(0, positions).view(positions.shape[0], *([1] * (x.dim() - 2)), 64)
    cos, sin = cs[..., :32], cs[..., 32:]
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = xf[..., :32], xf[..., 32:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.to(x.dtype)


def chunked(fn, row_chunk: Optional[int], *xs: torch.Tensor):
    """fn over the rows of xs in chunks of exactly row_chunk rows (the last one zero-padded), outputs
    concatenated and cut back to the real rows; fn returns a tensor or a tuple of tensors. row_chunk None: fn(*xs)."""
    n = xs[0].shape[0]
    if row_chunk is None or n == 0:
        return fn(*xs)
    pad = (-n) % row_chunk
    if pad:
        xs = tuple(torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))]) for x in xs)
    parts = [fn(*(x[i:i + row_chunk] for x in xs)) for i in range(0, n + pad, row_chunk)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[k] for p in parts])[:n] for k in range(len(parts[0])))
    return torch.cat(parts)[:n]


class PcpRuntime:
    """What every PcpAttention of a model shares during a step: the world (replicas, fence, RoPE table), the
    step's batch, the transport, row_chunk, optional stage timing, and what tests inspect (per layer and rank
    the top-k slots, when record_topk)."""

    STAGES = ("projections", "publication", "indexer", "attention", "mlp")

    def __init__(self, world, *, transport: str = "direct", row_chunk: Optional[int] = 64, timing: bool = False,
                 record_topk: bool = False, scale_read: str = "fp32", check_replicated: bool = True,
                 poison: bool = False):
        self.world, self.transport, self.row_chunk = world, transport, row_chunk
        self.step = None
        self.timing, self.record_topk, self.scale_read = timing, record_topk, scale_read
        self.check_replicated, self.poison = check_replicated, poison
        self.times = {}      # (layer, stage) -> seconds
        self.topk = {}       # layer -> [W] int32 [M, topk] slots

    def tick(self):
        if self.timing and self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        return time.perf_counter()

    def add_time(self, layer: int, stage: str, t0: float) -> float:
        t1 = self.tick()
        if self.timing:
            self.times[(layer, stage)] = self.times.get((layer, stage), 0.0) + (t1 - t0)
        return t1


class PcpAttention(torch.nn.Module):
    """Replaces `hf_attn` (its weights are shared, not copied); `returns_topk` follows the HF decoder layer's
    unpacking: GLM's returns (out, weights, topk), DeepSeek-V3.2's (out, weights)."""

    def __init__(self, hf_attn: torch.nn.Module, layer_idx: int, runtime: PcpRuntime, *, returns_topk: bool):
        super().__init__()
        self.hf = hf_attn
        self.layer_idx, self.runtime, self.returns_topk = layer_idx, runtime, returns_topk
        self.num_heads = hf_attn.num_heads
        self.nope, self.rope_dim, self.v_dim = hf_attn.qk_nope_head_dim, hf_attn.qk_rope_head_dim, hf_attn.v_head_dim
        if hf_attn.kv_lora_rank != 512 or self.rope_dim != 64 or hf_attn.q_a_proj is None:
            raise ValueError(f"layer {layer_idx}: pcpkv needs q_lora, kv_lora_rank 512 and qk_rope_head_dim 64 "
                             f"(got kv_lora_rank {hf_attn.kv_lora_rank}, rope {self.rope_dim})")
        self.indexer = getattr(hf_attn, "indexer", None)
        self.softmax_scale = float(hf_attn.scaling)

    def _weights(self):
        w = {"q_norm_w": self.hf.q_a_layernorm.weight, "kv_norm_w": self.hf.kv_a_layernorm.weight}
        if self.indexer is not None:
            w["index_ln_w"], w["index_ln_b"] = self.indexer.k_norm.weight, self.indexer.k_norm.bias
        return w

    def _absorbed_weights(self):
        """W_UK [H, nope, 512] and W_UV [H, v, 512] from kv_b_proj.weight [H * (nope + v), 512]."""
        wkv = self.hf.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, 512)
        return wkv[:, :self.nope], wkv[:, self.nope:]

    def forward(self, hidden_states, *args, prev_topk_indices=None, **kwargs):
        rt, world, step = self.runtime, self.runtime.world, self.runtime.step
        layer, W, chunk = self.layer_idx, self.runtime.world.W, self.runtime.row_chunk
        x = hidden_states[0]
        fmt = world.fmts[layer]
        ranks = world.local_ranks  # every rank (PcpWorld) or this process's one (DistPcpWorld); others stay None
        t = rt.tick()
        # 1. projections of every rank's own rows
        local, weights_idx = [None] * W, [None] * W
        for r in ranks:
            xl = step.local_rows(x, r)

            def proj(xc):
                q_c = self.hf.q_a_proj(xc)
                kv, k_pe = torch.split(self.hf.kv_a_proj_with_mqa(xc), [512, 64], dim=-1)
                if fmt.has_indexer:
                    return q_c, kv, k_pe, self.indexer.wk(xc), self.indexer.weights_proj(xc)
                return q_c, kv, k_pe

            out = chunked(proj, chunk, xl)
            local[r] = LocalInputs(out[0].contiguous(), out[1].contiguous(), out[2].contiguous(),
                                   out[3].contiguous() if fmt.has_indexer else None)
            weights_idx[r] = out[4].float().contiguous() if fmt.has_indexer else None
        t = rt.add_time(layer, "projections", t)
        # 2. publication into every replica
        M = step.max_local_tokens
        # poisoned with NaN in tests: a row the dispatch failed to write would reach the logits
        make = torch.full if rt.poison else (lambda shape, _, **kw: torch.empty(shape, **kw))
        q_c_out = [make((M, self.hf.q_lora_rank), float("nan"), dtype=torch.bfloat16, device=x.device)
                   if r in ranks else None for r in range(W)]
        world.publish(layer, rt.transport, local, step, self._weights(), q_c_out)
        world.check_published(layer, step)  # the replica check (check_replicas; a no-op when off)
        t = rt.add_time(layer, "publication", t)
        # 3. on each rank's own replica. A failure here on one process's rank (a DistPcpWorld) is held until the
        # attention all-gather, which every rank then reaches: raised before it, it left the peers inside that
        # all-gather and a retry's first exchange paired with theirs (gloo aborted the rank).
        try:
            topk, ys, t = self._attend(x, q_c_out, weights_idx, prev_topk_indices, t)
            failure = None
        except Exception as e:  # noqa: BLE001 - raised by owned_to_global on every rank, naming this one
            topk, ys, failure = None, None, e
        # 4. owned rows back to global order (across processes: an all-gather of every rank's rows)
        out = world.owned_to_global(ys, step, x, failure=failure)
        decode_rows = []
        for r, y in ys.items():
            copies = (step.global_index[r] >= 0) & ~step.owner[r]  # replicated decodes another rank owns
            if rt.check_replicated and bool(copies.any()):
                decode_rows.append((r, step.global_index[r][copies], y[copies]))
        if decode_rows:
            self._check_replicated_rows(decode_rows, out)
        rt.add_time(layer, "attention", t)
        res = out.unsqueeze(0)
        return (res, None, topk) if self.returns_topk else (res, None)

    def _attend(self, x, q_c_out, weights_idx, prev_topk_indices, t):
        """Steps 3a and 3b on this process's ranks: (topk [W], ys {rank: attention output rows [M, hidden]}, the
        time the indexer stage ended)."""
        rt, world, step = self.runtime, self.runtime.world, self.runtime.step
        layer, W, chunk, H = self.layer_idx, world.W, rt.row_chunk, self.num_heads
        fmt, ranks = world.fmts[layer], world.local_ranks
        # 3a. the indexer on each rank's own replica (or the shared layer's reuse)
        if fmt.has_indexer:
            topk = [None] * W
            for r in ranks:
                pos = step.positions[r]

                def index_q(qc, p):
                    q = self.indexer.wq_b(qc).view(qc.shape[0], -1, 128)
                    q_pe = apply_rope(q[..., :64], p, world.rope, world.spec.indexer_rope_interleave)
                    return quantize_index_q(torch.cat([q_pe, q[..., 64:]], dim=-1).contiguous())

                q_fp8, q_scale = chunked(index_q, chunk, q_c_out[r], pos)
                topk[r] = indexer_topk(q_fp8.contiguous(), q_scale.contiguous(), weights_idx[r], pos,
                                       step.request_idx[r], step.block_tables, world.index[layer][r],
                                       topk=self.indexer.index_topk, max_keys=step.max_position + 1)
        else:
            if prev_topk_indices is None:
                raise ValueError(f"layer {layer}: a shared (IndexShare) layer needs the previous indexer layer's top-k")
            topk = prev_topk_indices
        if rt.record_topk:
            rt.topk[layer] = [k.clone() if k is not None else None for k in topk]
        t = rt.add_time(layer, "indexer", t)
        # 3b. sparse MLA on each rank's own replica, W_UV, o_proj
        w_uk, w_uv = self._absorbed_weights()
        ys = {}
        for r in ranks:
            pos = step.positions[r]

            def query(qc, p):
                q = self.hf.q_b_proj(qc).view(qc.shape[0], H, self.nope + 64)
                q_abs = torch.einsum("thn,hnc->thc", q[..., :self.nope], w_uk)
                return torch.cat([q_abs, apply_rope(q[..., self.nope:], p, world.rope, True)], dim=-1)

            q576 = chunked(query, chunk, q_c_out[r], pos).contiguous()
            o, _ = sparse_mla(q576, world.mla[layer][r], topk[r], fmt=fmt, softmax_scale=self.softmax_scale,
                              scale_read=rt.scale_read)

            def up(oc):
                v = torch.einsum("thc,hvc->thv", oc.to(x.dtype), w_uv)
                return self.hf.o_proj(v.reshape(oc.shape[0], H * self.v_dim))

            ys[r] = chunked(up, chunk, o)
        return topk, ys, t

    def _check_replicated_rows(self, rows, out):
        """A replicated decode computed on every rank from its own replica must give the same bytes as its
        owner's: a replica that diverged shows here (RuntimeError naming the layer, rank and global token)."""
        for r, gidx, y in rows:
            bad = (y != out.index_select(0, gidx)).any(dim=-1).nonzero()
            if bad.numel():
                raise RuntimeError(f"layer {self.layer_idx}: rank {r}'s attention output of global token "
                                   f"{int(gidx[int(bad[0])])} differs from its owner's (replicas diverged)")
