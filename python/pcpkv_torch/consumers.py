"""The cache consumers as ops (SPEC section 6): the DSA lightning indexer (exact top-k over a replica's
indexer-K cache), sparse MLA attention over a replica's MLA cache (absorbed form) and the LSE merge.

Each op runs on CPU tensors (pcpkv's CPU reference, the oracle, after its full host validation of every
value) and on CUDA tensors (pcpkv's CUDA kernels, asynchronous on the current stream; positions, block
tables and indices are not read on the host there, so they must be valid: the CPU op checks them). Outputs
are allocated when not given (``out=`` buffers are written completely). T may be 0. Bad arguments raise
ValueError naming the argument and value before anything is written or launched.
"""

from __future__ import annotations

from typing import Optional

import torch

from .model_spec import CacheFormat, check_cache_format, scale_problem

__all__ = ["quantize_index_q", "indexer_topk", "sparse_mla", "lse_merge", "INDEXER_MAX_TOPK", "INDEXER_MAX_HEADS"]

Tensor = torch.Tensor

#: The indexer kernels' bounds (pcpkv::validate_indexer_scalars, src/consumers/kernels/cpu/indexer_reference.cpp;
#: the CUDA kernels share that validation): topk in [1, INDEXER_MAX_TOPK], index heads in [1, INDEXER_MAX_HEADS].
INDEXER_MAX_TOPK = 8192
INDEXER_MAX_HEADS = 128


def quantize_index_q(q: Tensor) -> tuple[Tensor, Tensor]:
    """Index queries to FP8 (SPEC section 3 rule, UE8M0 per (token, head)): s = 2^ceil(log2(max(amax, 1e-4)
    / 448)), bytes = E4M3(x / s) (round to nearest even, saturating at 448, NaN -> 0x7f).

    q: bfloat16 [T, H, 128] (after the indexer RoPE), contiguous. Returns (q_fp8 uint8 [T, H, 128], q_scale
    float32 [T, H]), on q's device. CPU: pcpkv::quantize_index_queries; CUDA: the same steps in ATen ops, bit
    for bit (tests hold both to the oracle). Raises ValueError for a wrong dtype/shape."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"quantize_index_q: q: expected bfloat16 [num_tokens, num_heads, 128], got {_desc(q)}")
    q_fp8 = torch.empty(q.shape, dtype=torch.uint8, device=q.device)
    q_scale = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    torch.ops.pcpkv.quantize_index_q(q, q_fp8, q_scale)
    return q_fp8, q_scale


def indexer_topk(q_fp8: Tensor, q_scale: Tensor, weights: Tensor, positions: Tensor, request_idx: Tensor,
                 block_tables: Tensor, index_cache: Tensor, *, topk: int, max_keys: Optional[int] = None,
                 out: Optional[Tensor] = None, positions_out: Optional[Tensor] = None,
                 logit: str = "exact") -> Tensor:
    """Exact top-k of the DSA indexer (pcpkv/consumers/indexer.h), per query token t of request request_idx[t]:
    score of key position j in 0..positions[t] (causal, inclusive) =
    k_scale[j] * sum_h relu(q_fp8[t, h] . k_fp8[j]) * weights[t, h] * (128 H)^-0.5 * q_scale[t, h];
    the k = min(topk, positions[t] + 1) best keys, score descending, equal scores by position ascending
    (NaN below -inf), as cache slots block_tables[req, j // block_size] * block_size + j % block_size; the
    row's tail is -1, and a padding token (request_idx[t] == -1) gets a row of -1.

    Inputs (one device, contiguous): q_fp8 uint8 [T, H, 128] and q_scale float32 [T, H] (quantize_index_q),
    H in [1, 128]; weights float32 [T, H] (weights_proj output, unscaled); positions int64 [T];
    request_idx int32 [T]; block_tables int32 [R, S] (the plan's, -1 padded); index_cache uint8
    [num_blocks, block_size, 132] (allocate_indexer_cache; padded block stride ok; CUDA: block stride a
    multiple of 4). topk in [1, 8192]. out / positions_out: optional int32 [T, topk] buffers (cache slots /
    key positions). logit: "exact" (the exact dot product rounded once, default) or "fp32_tree"
    (pcpkv/device/consumers.h); CPU and CUDA give identical top-k under either.

    max_keys (>= positions[t] + 1 of every real token) sizes the CUDA grid and workspace: default on CPU
    max(positions of real tokens) + 1, on CUDA block_tables.size(1) * block_size (an upper bound the tables
    imply, no host sync; give the real value when the tables are much wider than the requests). The CUDA
    workspace (scores of up to 128 MiB of tokens per pass) comes from torch's caching allocator.

    Returns out (int32 [T, topk]). Raises ValueError for a wrong dtype/shape/device, a bad topk/logit/
    max_keys (a bool is not an int), an output (out, positions_out) sharing memory with an input or the other
    output (naming both; out = request_idx.view(T, 1) or block_tables gave wrong slots); on CPU also for a request
    index, position or block table entry out of range."""
    T = q_fp8.shape[0] if isinstance(q_fp8, torch.Tensor) and q_fp8.dim() >= 1 else 0
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= INDEXER_MAX_TOPK:  # True: no width
        raise ValueError(f"indexer_topk: topk = {topk!r} must be an int in [1, {INDEXER_MAX_TOPK}]")
    if max_keys is not None and (isinstance(max_keys, bool) or not isinstance(max_keys, int) or
                                 not 1 <= max_keys < 2 ** 31):
        raise ValueError(f"indexer_topk: max_keys = {max_keys!r} must be an int in [1, 2^31) or None")
    if out is None:
        out = torch.empty((T, topk), dtype=torch.int32, device=q_fp8.device)
    torch.ops.pcpkv.indexer_topk(q_fp8, q_scale, weights, positions, request_idx, block_tables, index_cache, out,
                                 positions_out, topk, max_keys, logit)
    return out


def sparse_mla(q: Tensor, mla_cache: Tensor, indices: Tensor, *, fmt: CacheFormat, softmax_scale: float,
               out: Optional[Tensor] = None, lse: Optional[Tensor] = None, scale_read: str = "fp32",
               kernel: str = "mma") -> tuple[Tensor, Tensor]:
    """Sparse MLA attention, absorbed form (pcpkv/consumers/sparse_mla.h): for token t, head h over the valid slots
    j = indices[t, i] >= 0 (-1 skipped, duplicates counted per occurrence):
    s_j = softmax_scale * (q[t, h, :512] . kv_c_j + q[t, h, 512:] . k_pe_j),
    out[t, h] = sum_j softmax(s)_j kv_c_j [512], lse[t, h] = ln sum_j exp(s_j) (natural log, scale included).
    A token without a valid slot gets out = 0 and lse = -inf (an LSE merge then drops it).

    Inputs: q bfloat16 [T, H, 576] (q_nope absorbed by W_UK | q_pe), contiguous; mla_cache uint8
    [num_blocks, block_size, fmt.mla_row_bytes] (allocate_mla_cache, padded strides ok) in fmt.kv_format
    (fmt.k_scale read for "fp8"; fmt.has_indexer ignored); indices int32 [T, K] (K >= 1, cache slots, the
    indexer's output); softmax_scale a finite, positive, normal float32 (ModelSpec / model config:
    qk_head_dim^-0.5 * mscale^2; checked as given, before the float32 the kernels read).
    out float32 [T, H, 512] and lse float32 [T, H]: optional buffers. scale_read: "fp32" (the stored
    fp8_ds_mla tile scales) or "bf16" (rounded to bf16 first, as FlashMLA's SM90 reader does; pow2 scales
    read the same either way). kernel (CUDA only, checked everywhere): "mma" (bf16 tensor cores, default)
    or "simt" (fp32 CUDA cores).

    Accuracy: CPU = fp64 sums of the decoded cache values, rounded once to fp32; CUDA within
    pcpkv::SparseMlaBound of it (SparseMlaArith kBf16Mma for "mma", kFp32 for "simt").
    Returns (out, lse). Raises ValueError for a wrong dtype/shape/device, a bad format, softmax_scale,
    scale_read or kernel, out or lse sharing memory with an input or each other (naming both: lse a view into
    out was accepted); on CPU also for an index outside [-1, num_slots)."""
    check_cache_format(fmt, "sparse_mla")
    if why := scale_problem(softmax_scale):  # float() took '0.1' and True
        raise ValueError(f"sparse_mla: softmax_scale = {softmax_scale!r} {why}")
    T, H = (q.shape[0], q.shape[1]) if isinstance(q, torch.Tensor) and q.dim() == 3 else (0, 0)
    if out is None:
        out = torch.empty((T, H, 512), dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    torch.ops.pcpkv.sparse_mla(q, mla_cache, indices, out, lse, fmt.kv_format, fmt.ds_mla_scale, fmt.k_scale,
                               float(softmax_scale), scale_read, kernel)
    return out, lse


def lse_merge(outs: Tensor, lses: Tensor, *, out: Optional[Tensor] = None,
              lse: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Merge of S partial attentions by their LSEs (pcpkv/consumers/lse_merge.h), per (token, head): shards whose lse is
    finite or -inf (NaN / +inf count as -inf); m = max lse_n, L = ln sum_n exp(lse_n - m) + m,
    out = sum_n exp(lse_n - L) out_n (an empty shard's out_n is never read); all shards empty: out = 0,
    lse = -inf. CPU: fp64, rounded once; CUDA: fp32 within pcpkv::LseMergeBound.

    outs float32 [S, T, H, D] (S >= 1, D >= 1), lses float32 [S, T, H], contiguous, one device; out
    float32 [T, H, D] and lse [T, H]: optional buffers. Returns (out, lse). Raises ValueError for a wrong
    dtype/shape/device, or out / lse sharing memory with an input or each other (naming both)."""
    if not isinstance(outs, torch.Tensor) or outs.dim() != 4:
        raise ValueError(f"lse_merge: outs: expected float32 [num_shards, num_tokens, num_heads, head_dim], got "
                         f"{_desc(outs)}")
    S, T, H, D = outs.shape
    if out is None:
        out = torch.empty((T, H, D), dtype=torch.float32, device=outs.device)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=outs.device)
    torch.ops.pcpkv.lse_merge(outs, lses, out, lse)
    return out, lse


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return repr(type(t).__name__)
