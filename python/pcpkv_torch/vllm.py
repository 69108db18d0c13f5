"""Drop-in for engines already on vLLM's DeepSeek-V3.2 fused norm/RoPE/cache-write kernel.

``pcpkv_torch.vllm.fused_norm_rope`` takes the arguments of vLLM's ``fused_norm_rope`` (same names, order,
defaults, dtypes and cache layouts) and runs pcpkv's dispatch (``pcpkv_torch.dispatch``: the CPU reference
on CPU tensors, pcpkv's CUDA kernel on CUDA tensors). An engine swaps one import::

    # from vllm.models.deepseek_v32.common.kernels import fused_norm_rope
    from pcpkv_torch.vllm import fused_norm_rope

Where the signature comes from: vllm-project/vllm, ``vllm/models/deepseek_v32/common/kernels.py`` at commit
c73a65140a2101ea93979278cd326ee77d0b7bfb (``fused_norm_rope(positions, q_c, q_rms_norm_w, q_rms_eps, kv_c,
kv_rms_norm_w, kv_rms_eps, k_pe, k_rope_cos_sin_cache, index_k, index_k_layer_norm_w, index_k_layer_norm_bias,
index_k_layer_norm_eps, index_k_rope_cos_sin_cache, topk_indices_buffer, slot_mapping=None,
indexer_k_cache=None, mla_kv_cache=None, mla_kv_cache_dtype="auto", mla_k_scale=None, has_indexer=True,
index_rope_interleave=False, q_c_out=None) -> q_c_out``). Other versions of that file add arguments that
are accepted here as keyword-only: ``kv_c_out`` / ``k_pe_out`` / ``index_k_out`` (a later version, used by
vLLM's DSV32 PCP prefill), ``indexer_slot_mapping`` and ``write_kv_output`` (commit
01b9c661986f2fc8b8f4d93d32a47367acbaeb2b). The code here is pcpkv's own mapping onto its op.

Differences from vLLM's kernel (each converted, or refused with ValueError naming the argument):
  * fp8_ds_mla tile scale. vLLM's Triton writer stores the raw scale ``max(amax * (1/448), FLT_MIN)`` (a
    multiply by the rounded reciprocal); pcpkv's ``raw`` rule divides, ``max(amax / 448, FLT_MIN)``, as vLLM's
    CUDA writer ``concat_and_cache_ds_mla`` does. The two scales differ in the last bit for about half of all
    amax values (amax 336: 0.75000006 vs 0.75), and an e4m3 byte then differs where x / scale lies at a
    rounding tie; the decoded values agree to one scale ulp. Against an fp32 emulation of vLLM's math
    (tests/test_vllm_semantics.py, 10 seeded layers of 20 written tokens) 64% of the tile scales differed by a
    few ulps (the reciprocal, and the RMSNorm sum's order) and 12 of 102400 e4m3 bytes by one code; k_pe and
    q_c_out were identical. ``ds_mla_scale="pow2"`` (keyword) selects the power-of-two scales of vLLM
    #49435 / FlashMLA instead.
  * ``mla_kv_cache_dtype``: "auto" (the cache is bf16 [num_blocks, block_size, 576]), "fp8" / "fp8_e4m3"
    (uint8 or float8_e4m3fn [.., 576], values / mla_k_scale), "fp8_ds_mla" (uint8 or float8_e4m3fn [.., 656]).
    Any other string raises (vLLM writes e4m3 bytes for every string but "auto" / "fp8_ds_mla", "fp8_e5m2"
    and "bfloat16" included; pcpkv refuses rather than mislabel the bytes). An "auto" cache of another dtype
    (fp16) raises: pcpkv writes bf16.
  * cos/sin caches: vLLM's [max_position, 64] = [cos 32 | sin 32] layout is pcpkv's table layout; any float
    dtype and row stride is accepted and converted once to contiguous float32 (exact: vLLM's kernel loads the
    same values as float32). pcpkv rotates k_pe and index_k with one table, so
    ``index_k_rope_cos_sin_cache`` must hold the same values as ``k_rope_cos_sin_cache`` (vLLM builds them
    from the same RoPE parameters; they differ only in the rotation style, which is ``index_rope_interleave``).
    The check compares the values once per pair of tables (a host sync on CUDA the first time).
  * ``mla_k_scale`` (fp8 only): vLLM reads a float32 [1] device tensor in the kernel; pcpkv takes the scale
    as a host float, so a tensor is read with ``.item()`` once per tensor object and version (a host sync on
    CUDA; inference-mode tensors have no version: read once). Pass a Python float to avoid the read; a
    scale changed in place under inference mode is not seen. Ignored for "auto" and "fp8_ds_mla" (as vLLM).
    For "fp8" it must be a finite, positive, normal float32: 0, negatives, nan, inf and subnormals (1e-45,
    where vLLM's x / scale would saturate every value) raise.
  * Caches: pcpkv honours the caches' real block and row strides and requires the indexer cache to have the
    MLA cache's (num_blocks, block_size); vLLM derives its indexer block stride from the shape. Identical
    for the contiguous caches vLLM allocates. An indexer cache without an MLA cache raises (pcpkv's cache
    table always has the MLA row); an MLA cache without an indexer cache on an indexer layer writes the MLA
    rows only (and still fills the top-k buffer).
  * Outputs: pcpkv writes ``q_c_out``, ``kv_c_out``, ``k_pe_out`` and ``index_k_out`` for every token (later
    vLLM versions skip ``index_k_out`` rows of negative slots; on a shared layer both leave it untouched). ``q_c_out`` must be a contiguous bf16
    [T, q_lora_rank] tensor (None: allocated, as in vLLM). The top-k buffer's first T rows are filled with -1
    on indexer layers (as in vLLM; its other rows are untouched), so they must be contiguous int32. No output
    (the outputs, those top-k rows, the caches written) may share memory with an input or another output (an
    in-place q_c_out = q_c included): pcpkv's kernels read and write rows in any order.
  * ``write_kv_output=True`` (in-place kv_c / k_pe outputs) raises: pass ``kv_c_out`` / ``k_pe_out``.
    ``indexer_slot_mapping`` must be None or ``slot_mapping`` itself (pcpkv writes both caches at one slot).
  * Activations must be bf16 (the only activation dtype of pcpkv's kernels).

Like vLLM's, the work is one custom op (``torch.ops.pcpkv_vllm.fused_norm_rope``, mutation marks on the
caches, the top-k buffer and the outputs, a fake kernel), so ``torch.compile(fullgraph=True)`` traces through
the function. Under CUDA graphs call it once before capture: the first call per table converts / compares
the cos/sin tables, reads a k_scale tensor and builds the cache table (host work, a device copy), later calls
reuse them and only launch.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .model import FLT_MAX, CacheFormat, q_lora_rank_problem, scale_problem
from .ops import dispatch
from .tables import CacheTargets, first_overlap

__all__ = ["fused_norm_rope", "KV_CACHE_DTYPES", "SIGNATURE_SOURCE"]

Tensor = torch.Tensor

SIGNATURE_SOURCE = ("vllm-project/vllm vllm/models/deepseek_v32/common/kernels.py "
                    "@ c73a65140a2101ea93979278cd326ee77d0b7bfb")

#: vLLM's kv cache dtype strings -> pcpkv's kv_format, and the cache tensor each needs (dtypes, last dim).
KV_CACHE_DTYPES = {
    "auto": ("bf16", (torch.bfloat16,), 576),
    "fp8": ("fp8", (torch.uint8, torch.float8_e4m3fn), 576),
    "fp8_e4m3": ("fp8", (torch.uint8, torch.float8_e4m3fn), 576),
    "fp8_ds_mla": ("fp8_ds_mla", (torch.uint8, torch.float8_e4m3fn), 656),
}

_MAX_CACHED = 256  # entries per memo below (one per layer and table in an engine)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)} strides {list(t.stride())} on {t.device}"


def _fail(name: str, what: str, t=None):
    raise ValueError(f"fused_norm_rope: {name}: {what}" + ("" if t is None else f", got {_describe(t)}"))


def _rows(t, name: str, T: int, cols: Optional[int], device) -> int:
    """Checks a bf16 activation [T, cols] with unit inner stride on `device`; returns its width."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.bfloat16 or t.shape[0] != T or (
            cols is not None and t.shape[1] != cols) or (t.shape[1] > 1 and t.stride(1) != 1) or t.device != device:
        _fail(name, f"expected bfloat16 [{T} (positions), {cols if cols is not None else 'n'}] with unit inner "
                    f"stride on {device} (positions' device)", t)
    return t.shape[1]


def _q_lora_rank(q_c: Tensor) -> int:
    """q_c's width [T, q_lora_rank], refused unless pcpkv's dispatch takes it (a zero-width q_c would reach the op
    as null pointers, which its contract reads as "no Q norm": the caches written, q_c_out not)."""
    r = q_c.shape[1]
    if why := q_lora_rank_problem(r):
        _fail("q_c", f"width q_lora_rank = {r} {why} (pcpkv's dispatch)", q_c)
    return r


def _weight(t, name: str, n: int, device):
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape != (n,) or t.device != device:
        _fail(name, f"expected a float [{n}] weight on {device}", t)


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and
                      a.dtype == b.dtype and a.device == b.device)


def _version(t: Tensor):
    """t's in-place modification counter; None for an inference-mode tensor (vLLM runs under
    torch.inference_mode, whose tensors have none: its cos/sin buffers are never modified)."""
    try:
        return t._version
    except RuntimeError:
        return None


class _Memo:
    """Results keyed by source tensors, valid while each source is alive and unmodified (same object and
    _version): a new tensor at a freed tensor's address never hits a stale entry, and an entry is dropped
    when a source dies (a converted table does not outlive its source)."""

    def __init__(self):
        self._d = {}

    def get(self, srcs, make):
        key = tuple(id(s) for s in srcs)
        hit = self._d.get(key)
        if hit is not None and all(r() is s and _version(s) == v for (r, v), s in zip(hit[0], srcs)):
            return hit[1]
        value = make()
        if len(self._d) >= _MAX_CACHED:
            self._d.clear()
        drop = lambda _ref, d=self._d, k=key: d.pop(k, None)  # noqa: E731
        self._d[key] = ([(weakref.ref(s, drop), _version(s)) for s in srcs], value)
        return value


_tables = _Memo()      # cos/sin cache -> contiguous float32 copy
_same_values = _Memo()  # (k table, index table) -> bool
_targets = {}          # cache pointers and geometry -> CacheTargets (a pointer table stays right while equal)


def _rope_table(t, name: str, device) -> Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != 64 or not t.is_floating_point() or (
            t.shape[0] > 1 and t.stride(1) != 1):
        _fail(name, "expected a float [max_position, 64] cos/sin cache ([cos 32 | sin 32] per position; pcpkv's "
                    "rotary dims are 64)", t)
    if t.device != device:
        _fail(name, f"is on {t.device} but positions on {device}")
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return _tables.get((t,), lambda: t.to(torch.float32).contiguous())


def _check_index_table(k_table: Tensor, idx_table: Tensor, k_f32: Tensor, idx_f32: Tensor):
    if _same_tensor(k_table, idx_table):
        return
    if idx_table.device != k_table.device:
        _fail("index_k_rope_cos_sin_cache", f"is on {idx_table.device} but k_rope_cos_sin_cache on {k_table.device}")
    same = _same_values.get((k_table, idx_table),
                            lambda: k_f32.shape == idx_f32.shape and bool(torch.equal(k_f32, idx_f32)))
    if not same:
        _fail("index_k_rope_cos_sin_cache", "holds other values than k_rope_cos_sin_cache; pcpkv rotates k_pe and "
                                            "index_k with one table (the rotation style is index_rope_interleave)")


def _scale_args(mla_k_scale) -> tuple[Optional[Tensor], float]:
    """mla_k_scale (None, a number or a float [1] tensor) as the op's (tensor, value) pair."""
    if mla_k_scale is None:
        return None, 1.0
    if isinstance(mla_k_scale, (int, float)) and not isinstance(mla_k_scale, bool):
        return None, float(mla_k_scale)
    if isinstance(mla_k_scale, torch.Tensor) and mla_k_scale.numel() == 1 and mla_k_scale.is_floating_point():
        return mla_k_scale, 0.0
    _fail("mla_k_scale", "expected None, a float or a float [1] tensor", mla_k_scale)


_scales = _Memo()  # k_scale tensor -> its value (read once: a host sync on CUDA)
_weights = _Memo()  # norm weight -> contiguous float32 copy


def _k_scale(t: Optional[Tensor], value: float) -> float:
    v = value if t is None else _scales.get((t,), lambda: float(t.detach().reshape(()).item()))
    if why := scale_problem(v):  # a float32 in the kernels: 1e300 would be refused there as pcpkv's k_scale = inf
        _fail("mla_k_scale", f"= {v!r} {why}")
    return v


def _mla_bytes(cache, dtype_str: str, device) -> Tensor:
    _, dtypes, last = KV_CACHE_DTYPES[dtype_str]
    if not isinstance(cache, torch.Tensor) or cache.dim() != 3 or cache.dtype not in dtypes or (
            cache.shape[2] != last) or cache.stride(2) != 1:
        _fail("mla_kv_cache", f"expected {' or '.join(str(d) for d in dtypes)} [num_blocks, block_size, {last}] with "
                              f"unit inner stride for mla_kv_cache_dtype = {dtype_str!r}", cache)
    if cache.device != device:
        _fail("mla_kv_cache", f"is on {cache.device} but positions on {device}")
    return cache.view(torch.uint8)


def _index_bytes(cache, mla: Tensor) -> Tensor:
    if not isinstance(cache, torch.Tensor) or cache.dim() != 3 or cache.dtype not in (torch.uint8, torch.float8_e4m3fn) \
            or cache.shape[2] != 132:
        _fail("indexer_k_cache", "expected uint8 or float8_e4m3fn [num_blocks, block_size, 132]", cache)
    if cache.device != mla.device:
        _fail("indexer_k_cache", f"is on {cache.device} but mla_kv_cache on {mla.device}")
    if cache.shape[:2] != mla.shape[:2]:
        _fail("indexer_k_cache", f"has (num_blocks, block_size) = {tuple(cache.shape[:2])} but mla_kv_cache "
                                 f"{tuple(mla.shape[:2])}; pcpkv writes both caches at one slot")
    return cache.view(torch.uint8)


def _cache_targets(mla: Tensor, idx: Optional[Tensor], fmt: CacheFormat) -> CacheTargets:
    """The one-replica table of (mla, idx), built once per address and geometry (building copies it to the
    device, which must not happen per call or inside a graph capture)."""
    key = (mla.data_ptr(), tuple(mla.shape), mla.stride(), str(mla.device), fmt,
           None if idx is None else (idx.data_ptr(), tuple(idx.shape), idx.stride()))
    t = _targets.get(key)
    if t is None:
        # tensors=(): the table must not keep the caches alive; each call declares them as written instead.
        t = CacheTargets.from_pointers([mla.data_ptr()], None if idx is None else [idx.data_ptr()], like_mla=mla,
                                       like_index=idx, fmt=fmt)
        if len(_targets) >= _MAX_CACHED:
            _targets.clear()
        _targets[key] = t
    return t


def fused_norm_rope(
    positions: Tensor,
    q_c: Tensor,
    q_rms_norm_w: Tensor,
    q_rms_eps: float,
    kv_c: Tensor,
    kv_rms_norm_w: Tensor,
    kv_rms_eps: float,
    k_pe: Tensor,
    k_rope_cos_sin_cache: Tensor,
    index_k: Optional[Tensor],
    index_k_layer_norm_w: Optional[Tensor],
    index_k_layer_norm_bias: Optional[Tensor],
    index_k_layer_norm_eps: float,
    index_k_rope_cos_sin_cache: Optional[Tensor],
    topk_indices_buffer: Tensor,
    slot_mapping: Optional[Tensor] = None,
    indexer_k_cache: Optional[Tensor] = None,
    mla_kv_cache: Optional[Tensor] = None,
    mla_kv_cache_dtype: str = "auto",
    mla_k_scale=None,
    has_indexer: bool = True,
    index_rope_interleave: bool = False,
    q_c_out: Optional[Tensor] = None,
    *,
    kv_c_out: Optional[Tensor] = None,
    k_pe_out: Optional[Tensor] = None,
    index_k_out: Optional[Tensor] = None,
    indexer_slot_mapping: Optional[Tensor] = None,
    write_kv_output: bool = False,
    ds_mla_scale: str = "raw",
) -> Tensor:
    """vLLM's DeepSeek-V3.2 ``fused_norm_rope`` on pcpkv's dispatch kernel, for the T = positions.shape[0]
    tokens of one layer (see the module docstring for the source and every difference). Returns q_c_out.

    Inputs (bf16 activations with unit inner stride; row strides free, e.g. splits of one projection):
    positions int64 [T]; q_c [T, q_lora_rank] (a multiple of 8 in [8, 4096], as pcpkv's dispatch takes) with
    q_rms_norm_w [q_lora_rank] and q_rms_eps; kv_c [T, 512] (kv_a_proj's latent part, before its RMSNorm) with
    kv_rms_norm_w [512] and kv_rms_eps; k_pe [T, 64];
    k_rope_cos_sin_cache [max_position, 64] (any float dtype); on indexer layers (has_indexer) index_k
    [T, 128] with its LayerNorm index_k_layer_norm_w / _bias [128] and index_k_layer_norm_eps, and
    index_k_rope_cos_sin_cache (same values as k_rope_cos_sin_cache); topk_indices_buffer int32 [>= T, topk].
    Norm weights may be any float dtype (converted to float32 once per weight tensor, exactly for bf16).

    Writes: q_c_out [T, q_lora_rank] bf16 = RMSNorm(q_c); on indexer layers topk_indices_buffer[:T] = -1;
    with slot_mapping int64 [T] (-1: no row) and mla_kv_cache (format mla_kv_cache_dtype) the token's MLA row
    (RMSNorm(kv_c), interleaved-RoPE k_pe) and, with indexer_k_cache uint8 [num_blocks, block_size, 132], its
    indexer row (LayerNorm + RoPE, NeoX or interleaved per index_rope_interleave, UE8M0 fp8); optionally the
    bf16 rows kv_c_out [T, 512], k_pe_out [T, 64], index_k_out [T, 128] (contiguous).
    Keyword-only additions: ds_mla_scale ("raw", vLLM's rule, or "pow2"), mla_k_scale may be a float.

    Raises ValueError naming the argument (before anything is written) for a dtype, shape or device the
    mapping cannot take, and for each refused vLLM semantics listed in the module docstring; pcpkv's op then
    checks the rest (CPU: slot and position values too)."""
    for name, v in (("has_indexer", has_indexer), ("index_rope_interleave", index_rope_interleave),
                    ("write_kv_output", write_kv_output)):
        if not isinstance(v, bool):
            _fail(name, f"= {v!r} must be a bool")
    if write_kv_output:
        _fail("write_kv_output", "= True (in-place kv_c / k_pe outputs) is not supported; pass kv_c_out / k_pe_out")
    if not isinstance(mla_kv_cache_dtype, str) or mla_kv_cache_dtype not in KV_CACHE_DTYPES:
        _fail("mla_kv_cache_dtype", f"= {mla_kv_cache_dtype!r}; pcpkv maps {sorted(KV_CACHE_DTYPES)} (vLLM would write "
                                    "e4m3 bytes for any other string)")
    if ds_mla_scale not in ("raw", "pow2"):
        _fail("ds_mla_scale", f"= {ds_mla_scale!r}; expected 'raw' (vLLM's rule) or 'pow2'")
    for name, v in (("q_rms_eps", q_rms_eps), ("kv_rms_eps", kv_rms_eps), ("index_k_layer_norm_eps",
                                                                          index_k_layer_norm_eps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            _fail(name, f"= {v!r} must be a float")
        if not 0 <= v <= FLT_MAX:  # the kernels take float32: 1e300 would reach them as inf, named as pcpkv's eps
            _fail(name, f"= {v!r} must be finite (as float32) and >= 0")
    # The op's schema takes tensors (or None) only: anything else is refused here, naming the argument.
    for name, v, optional in (
            ("positions", positions, False), ("q_c", q_c, False), ("q_rms_norm_w", q_rms_norm_w, False),
            ("kv_c", kv_c, False), ("kv_rms_norm_w", kv_rms_norm_w, False), ("k_pe", k_pe, False),
            ("k_rope_cos_sin_cache", k_rope_cos_sin_cache, False), ("index_k", index_k, True),
            ("index_k_layer_norm_w", index_k_layer_norm_w, True),
            ("index_k_layer_norm_bias", index_k_layer_norm_bias, True),
            ("index_k_rope_cos_sin_cache", index_k_rope_cos_sin_cache, True),
            ("topk_indices_buffer", topk_indices_buffer, False), ("slot_mapping", slot_mapping, True),
            ("indexer_k_cache", indexer_k_cache, True), ("mla_kv_cache", mla_kv_cache, True),
            ("q_c_out", q_c_out, True), ("kv_c_out", kv_c_out, True), ("k_pe_out", k_pe_out, True),
            ("index_k_out", index_k_out, True), ("indexer_slot_mapping", indexer_slot_mapping, True)):
        if not (isinstance(v, torch.Tensor) or (optional and v is None)):
            _fail(name, f"expected a tensor{' or None' if optional else ''}", v)
    if positions.dim() != 1 or q_c.dim() != 2:
        _fail("positions" if positions.dim() != 1 else "q_c", "expected int64 [num_tokens] positions and "
              "q_c [num_tokens, q_lora_rank]", positions if positions.dim() != 1 else q_c)
    _q_lora_rank(q_c)  # before q_c_out is allocated from it
    scale_t, scale_v = _scale_args(mla_k_scale)
    if q_c_out is None:  # as vLLM: allocated here, returned
        q_c_out = torch.empty((positions.shape[0], q_c.shape[-1]), dtype=torch.bfloat16, device=q_c.device)
    # One opaque custom op (as vLLM registers its own), so torch.compile(fullgraph=True) traces through it;
    # eager calls skip the dispatcher's custom-op layers (~0.1 ms of host time per call).
    op = torch.ops.pcpkv_vllm.fused_norm_rope if torch.compiler.is_compiling() else _fused_norm_rope_impl
    op(
        positions, q_c, q_rms_norm_w, float(q_rms_eps), kv_c, kv_rms_norm_w, float(kv_rms_eps), k_pe,
        k_rope_cos_sin_cache, index_k, index_k_layer_norm_w, index_k_layer_norm_bias, float(index_k_layer_norm_eps),
        index_k_rope_cos_sin_cache, topk_indices_buffer, slot_mapping, indexer_k_cache, mla_kv_cache,
        mla_kv_cache_dtype, scale_t, scale_v, has_indexer, index_rope_interleave, q_c_out, kv_c_out, k_pe_out,
        index_k_out, indexer_slot_mapping, ds_mla_scale)
    return q_c_out


def _fused_norm_rope_impl(
    positions: Tensor, q_c: Tensor, q_rms_norm_w: Tensor, q_rms_eps: float, kv_c: Tensor, kv_rms_norm_w: Tensor,
    kv_rms_eps: float, k_pe: Tensor, k_rope_cos_sin_cache: Tensor, index_k: Optional[Tensor],
    index_k_layer_norm_w: Optional[Tensor], index_k_layer_norm_bias: Optional[Tensor], index_k_layer_norm_eps: float,
    index_k_rope_cos_sin_cache: Optional[Tensor], topk_indices_buffer: Tensor, slot_mapping: Optional[Tensor],
    indexer_k_cache: Optional[Tensor], mla_kv_cache: Optional[Tensor], mla_kv_cache_dtype: str,
    mla_k_scale: Optional[Tensor], mla_k_scale_value: float, has_indexer: bool, index_rope_interleave: bool,
    q_c_out: Tensor, kv_c_out: Optional[Tensor], k_pe_out: Optional[Tensor], index_k_out: Optional[Tensor],
    indexer_slot_mapping: Optional[Tensor], ds_mla_scale: str) -> None:
    """The mapping onto pcpkv_torch.dispatch (runs eagerly, also under torch.compile: tensor addresses and the
    tables' memos are looked at here, at run time)."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.dtype != torch.int64:
        _fail("positions", "expected int64 [num_tokens]", positions)
    T, device = positions.shape[0], positions.device
    _rows(q_c, "q_c", T, None, device)
    r = _q_lora_rank(q_c)
    _weight(q_rms_norm_w, "q_rms_norm_w", r, device)
    _rows(kv_c, "kv_c", T, 512, device)
    _weight(kv_rms_norm_w, "kv_rms_norm_w", 512, device)
    _rows(k_pe, "k_pe", T, 64, device)
    rope = _rope_table(k_rope_cos_sin_cache, "k_rope_cos_sin_cache", device)
    if not isinstance(topk_indices_buffer, torch.Tensor) or topk_indices_buffer.dim() != 2:
        _fail("topk_indices_buffer", "expected int32 [max_tokens, topk]", topk_indices_buffer)
    topk = None
    if has_indexer:
        _rows(index_k, "index_k", T, 128, device)
        _weight(index_k_layer_norm_w, "index_k_layer_norm_w", 128, device)
        _weight(index_k_layer_norm_bias, "index_k_layer_norm_bias", 128, device)
        idx_rope = _rope_table(index_k_rope_cos_sin_cache, "index_k_rope_cos_sin_cache", device)
        _check_index_table(k_rope_cos_sin_cache, index_k_rope_cos_sin_cache, rope, idx_rope)
        topk = topk_indices_buffer[:T]
        if topk_indices_buffer.dtype != torch.int32 or topk_indices_buffer.shape[0] < T or not topk.is_contiguous() \
                or topk.device != device:
            _fail("topk_indices_buffer", f"expected int32 [>= {T}, topk] on {device} whose first {T} rows are "
                                         "contiguous", topk_indices_buffer)
    else:
        index_k_out = None  # a shared layer leaves it untouched, as vLLM's kernel does
    if (not isinstance(q_c_out, torch.Tensor) or q_c_out.dtype != torch.bfloat16 or q_c_out.shape != (T, r) or
            not q_c_out.is_contiguous() or q_c_out.device != device):
        _fail("q_c_out", f"expected a contiguous bfloat16 [{T}, {r}] on {device}", q_c_out)

    kv_format = KV_CACHE_DTYPES[mla_kv_cache_dtype][0]
    k_scale = _k_scale(mla_k_scale, mla_k_scale_value) if kv_format == "fp8" else 1.0
    if indexer_slot_mapping is not None and not (
            isinstance(slot_mapping, torch.Tensor) and isinstance(indexer_slot_mapping, torch.Tensor) and
            _same_tensor(slot_mapping, indexer_slot_mapping)):
        _fail("indexer_slot_mapping", "must be None or slot_mapping itself: pcpkv writes the MLA and indexer rows "
                                      "of a token at one slot")
    if not has_indexer:
        indexer_k_cache = None  # a shared layer writes no indexer row (vLLM drops it too)
    targets, mla, idx = None, None, None
    writes_idx = indexer_k_cache is not None and mla_kv_cache is not None
    if slot_mapping is not None and (mla_kv_cache is not None or indexer_k_cache is not None):
        if mla_kv_cache is None:
            _fail("mla_kv_cache", "is None but indexer_k_cache is given: pcpkv's cache table always has the MLA row")
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64 or (
                slot_mapping.shape != (T,)) or slot_mapping.device != device:
            _fail("slot_mapping", f"expected int64 [{T}] on {device}", slot_mapping)
        mla = _mla_bytes(mla_kv_cache, mla_kv_cache_dtype, device)
        idx = _index_bytes(indexer_k_cache, mla) if writes_idx else None
        if has_indexer and idx is None and index_k_out is not None:
            _fail("index_k_out", "needs indexer_k_cache when mla_kv_cache is given (pcpkv's MLA-only write has no "
                                 "indexer output)")
        fmt = CacheFormat(kv_format, ds_mla_scale, k_scale, has_indexer=idx is not None)
    else:
        slot_mapping = None  # vLLM's profiling run: no cache is written
        fmt = CacheFormat(kv_format, ds_mla_scale, k_scale, has_indexer=has_indexer)
    # What the call writes against what it reads (and the other writes), before the cache table goes to the device.
    reads = [("positions", positions), ("q_c", q_c), ("q_rms_norm_w", q_rms_norm_w), ("kv_c", kv_c),
             ("kv_rms_norm_w", kv_rms_norm_w), ("k_pe", k_pe), ("k_rope_cos_sin_cache", k_rope_cos_sin_cache),
             ("slot_mapping", slot_mapping), ("mla_k_scale", mla_k_scale)]
    if fmt.has_indexer:
        reads += [("index_k", index_k), ("index_k_layer_norm_w", index_k_layer_norm_w),
                  ("index_k_layer_norm_bias", index_k_layer_norm_bias),
                  ("index_k_rope_cos_sin_cache", index_k_rope_cos_sin_cache)]
    hit = first_overlap([("q_c_out", q_c_out), ("kv_c_out", kv_c_out), ("k_pe_out", k_pe_out),
                         ("index_k_out", index_k_out), ("topk_indices_buffer", topk),
                         ("mla_kv_cache", mla_kv_cache if mla is not None else None),
                         ("indexer_k_cache", indexer_k_cache if idx is not None else None)], reads)
    if hit:
        (a, ta), (b, tb) = hit
        _fail(a, f"shares memory with {b} ({_describe(tb)}): pcpkv reads the inputs and writes the outputs row by "
                 "row in any order, so an output must not overlap an input or another output", ta)
    if mla is not None:
        targets = _cache_targets(mla, idx, fmt)

    def f32(w):  # the layer's norm weights, converted once (not per call, nor inside a graph capture)
        return w if w.dtype == torch.float32 and w.is_contiguous() else _weights.get(
            (w,), lambda: w.to(torch.float32).contiguous())

    dispatch(kv_c, k_pe, positions, f32(kv_rms_norm_w), rope, fmt=fmt, q_c=q_c, q_norm_w=f32(q_rms_norm_w),
             index_k=index_k if fmt.has_indexer else None,
             index_ln_w=f32(index_k_layer_norm_w) if fmt.has_indexer else None,
             index_ln_b=f32(index_k_layer_norm_bias) if fmt.has_indexer else None,
             slot_mapping=slot_mapping, targets=targets, q_c_out=q_c_out, kv_c_out=kv_c_out, k_pe_out=k_pe_out,
             index_k_out=index_k_out, topk_fill=topk, q_eps=float(q_rms_eps), kv_eps=float(kv_rms_eps),
             index_eps=float(index_k_layer_norm_eps), mla_rope_interleaved=True,
             index_rope_interleaved=index_rope_interleave, index_hadamard=False,
             written=[t for t in (mla, idx) if t is not None])


_fused_norm_rope_op = torch.library.custom_op(
    "pcpkv_vllm::fused_norm_rope", _fused_norm_rope_impl,
    mutates_args=("topk_indices_buffer", "indexer_k_cache", "mla_kv_cache", "q_c_out", "kv_c_out", "k_pe_out",
                  "index_k_out"))


@_fused_norm_rope_op.register_fake
def _(*args, **kwargs):
    return None
