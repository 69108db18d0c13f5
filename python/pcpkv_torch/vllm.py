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
    CUDA; inference-mode tensors have no version: read once; a meta tensor, which has no value, raises). Pass a Python float to avoid the read; a
    scale changed in place under inference mode is not seen. Ignored for "auto" and "fp8_ds_mla" (as vLLM).
    For "fp8" it must be a finite, positive, normal float32: 0, negatives, nan, inf and subnormals (1e-45,
    where vLLM's x / scale would saturate every value) raise.
  * Caches: pcpkv honours the caches' real block and row strides and requires the indexer cache to have the
    MLA cache's (num_blocks, block_size), or with an ``indexer_slot_mapping`` its block_size and any num_blocks
    (and any padded block stride); vLLM derives its indexer block stride from the shape. Identical
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
    ``indexer_slot_mapping`` (as vLLM's, whose hybrid allocator can give the indexer cache its own block table):
    int64 [T], token t's indexer row goes to slot indexer_slot_mapping[t] of indexer_k_cache (-1: none), its MLA
    row to slot_mapping[t] (docs/spec.md 4.2); None or ``slot_mapping`` itself: one slot addresses both caches
    (the default form, no second mapping read). Ignored where no indexer row is written (vLLM drops it too).
  * Activations must be bf16 (the only activation dtype of pcpkv's kernels).

Like vLLM's, the work is one custom op (``torch.ops.pcpkv_vllm.fused_norm_rope``, mutation marks on the
caches, the top-k buffer and the outputs, a fake kernel), so ``torch.compile(fullgraph=True)`` traces through
the function. The op is C++ (python/csrc/vllm_dropin.cpp: the checks, the memos of the first-call work below, then
pcpkv's dispatch op), so an eager call costs about what ``pcpkv_torch.dispatch`` costs on the same work (docs/perf.md
39). Under CUDA graphs call it once before capture: the first call per table converts / compares the cos/sin tables,
reads a k_scale tensor and builds the cache table (host work, a device copy), later calls reuse them and only launch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import _C  # noqa: F401  registers torch.ops.pcpkv_vllm.fused_norm_rope
from .model_spec import FLT_MAX

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


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)} strides {list(t.stride())} on {t.device}"


def _fail(name: str, what: str, t=None):
    raise ValueError(f"fused_norm_rope: {name}: {what}" + ("" if t is None else f", got {_describe(t)}"))


def _check_scalars(has_indexer, index_rope_interleave, write_kv_output, mla_kv_cache_dtype, ds_mla_scale, q_rms_eps,
                   kv_rms_eps, index_k_layer_norm_eps) -> None:
    """The arguments the op's schema takes as bool, str and float, refused naming the argument (the schema would
    convert an int to a bool or a float silently, or raise without the name)."""
    for name, v in (("has_indexer", has_indexer), ("index_rope_interleave", index_rope_interleave),
                    ("write_kv_output", write_kv_output)):
        if not isinstance(v, bool):
            _fail(name, f"= {v!r} must be a bool")
    if write_kv_output:
        _fail("write_kv_output", "= True (in-place kv_c / k_pe outputs) is not supported; pass kv_c_out / k_pe_out")
    if not isinstance(mla_kv_cache_dtype, str) or mla_kv_cache_dtype not in KV_CACHE_DTYPES:
        _fail("mla_kv_cache_dtype", f"= {mla_kv_cache_dtype!r}; pcpkv maps {sorted(KV_CACHE_DTYPES)} (vLLM would write "
                                    "e4m3 bytes for any other string)")
    if ds_mla_scale not in _DS_MLA:
        _fail("ds_mla_scale", f"= {ds_mla_scale!r}; expected 'raw' (vLLM's rule) or 'pow2'")
    for name, v in (("q_rms_eps", q_rms_eps), ("kv_rms_eps", kv_rms_eps), ("index_k_layer_norm_eps",
                                                                          index_k_layer_norm_eps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            _fail(name, f"= {v!r} must be a float")
        if not 0 <= v <= FLT_MAX:  # the kernels take float32: 1e300 would reach them as inf, named as pcpkv's eps
            _fail(name, f"= {v!r} must be finite (as float32) and >= 0")


def _check_tensors(args: dict) -> None:
    """ValueError naming the first argument that is not a tensor (or None where optional): the op's schema takes
    tensors only, and its own error does not say which argument was wrong in these terms."""
    for name, optional in _TENSOR_ARGS:
        v = args[name]
        if not (isinstance(v, torch.Tensor) or (optional and v is None)):
            _fail(name, f"expected a tensor{' or None' if optional else ''}", v)


#: The tensor arguments, in the order they are checked, and whether each may be None.
_TENSOR_ARGS = (("positions", False), ("q_c", False), ("q_rms_norm_w", False), ("kv_c", False),
                ("kv_rms_norm_w", False), ("k_pe", False), ("k_rope_cos_sin_cache", False), ("index_k", True),
                ("index_k_layer_norm_w", True), ("index_k_layer_norm_bias", True),
                ("index_k_rope_cos_sin_cache", True), ("topk_indices_buffer", False), ("slot_mapping", True),
                ("indexer_k_cache", True), ("mla_kv_cache", True), ("q_c_out", True), ("kv_c_out", True),
                ("k_pe_out", True), ("index_k_out", True), ("indexer_slot_mapping", True))


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
    bf16 rows kv_c_out [T, 512], k_pe_out [T, 64], index_k_out [T, 128] (contiguous). indexer_slot_mapping
    int64 [T] (keyword): the indexer rows' own slots (module docstring), else slot_mapping's.
    Keyword-only additions: ds_mla_scale ("raw", vLLM's rule, or "pow2"), mla_k_scale may be a float.

    Raises ValueError naming the argument (before anything is written) for a dtype, shape or device the
    mapping cannot take, and for each refused vLLM semantics listed in the module docstring; pcpkv's op then
    checks the rest (CPU: slot and position values too)."""
    # The scalars: a fast test of the usual types, the full checks (which name the argument) otherwise.
    if not (write_kv_output is False and type(has_indexer) is bool and type(index_rope_interleave) is bool and
            type(mla_kv_cache_dtype) is str and mla_kv_cache_dtype in KV_CACHE_DTYPES and ds_mla_scale in _DS_MLA
            and type(q_rms_eps) is float and type(kv_rms_eps) is float and type(index_k_layer_norm_eps) is float
            and 0 <= q_rms_eps <= FLT_MAX and 0 <= kv_rms_eps <= FLT_MAX and 0 <= index_k_layer_norm_eps <= FLT_MAX):
        _check_scalars(has_indexer, index_rope_interleave, write_kv_output, mla_kv_cache_dtype, ds_mla_scale, q_rms_eps,
                       kv_rms_eps, index_k_layer_norm_eps)
    # mla_k_scale (None, a number or a float [1] tensor) as the op's (tensor, value) pair; the op checks a tensor's
    # shape and dtype (after the checks of positions and q_c, as before).
    scale_t, scale_v = None, 1.0
    if isinstance(mla_k_scale, torch.Tensor):
        scale_t, scale_v = mla_k_scale, 0.0
    elif isinstance(mla_k_scale, (int, float)) and not isinstance(mla_k_scale, bool):
        scale_v = float(mla_k_scale)
    elif mla_k_scale is not None:
        _check_tensors(locals())
        _fail("mla_k_scale", "expected None, a float or a float [1] tensor", mla_k_scale)
    if q_c_out is None:  # as vLLM: allocated here, returned (the op checks positions and q_c first)
        if isinstance(positions, torch.Tensor) and positions.dim() == 1 and isinstance(q_c, torch.Tensor) and \
                q_c.dim() == 2:
            q_c_out = torch.empty((positions.shape[0], q_c.shape[1]), dtype=torch.bfloat16, device=q_c.device)
        else:
            _check_tensors(locals())
    args = (positions, q_c, q_rms_norm_w, q_rms_eps, kv_c, kv_rms_norm_w, kv_rms_eps, k_pe, k_rope_cos_sin_cache,
            index_k, index_k_layer_norm_w, index_k_layer_norm_bias, index_k_layer_norm_eps,
            index_k_rope_cos_sin_cache, topk_indices_buffer, slot_mapping, indexer_k_cache, mla_kv_cache,
            mla_kv_cache_dtype, scale_t, scale_v, has_indexer, index_rope_interleave, q_c_out, kv_c_out, k_pe_out,
            index_k_out, indexer_slot_mapping, ds_mla_scale)
    if torch.compiler.is_compiling():
        _OP(*args)  # traced: the fake kernel below
        return q_c_out
    try:
        _OP_EAGER(*args)  # the C++ op (python/csrc/vllm_dropin.cpp): its checks, then pcpkv's dispatch
    except (TypeError, RuntimeError):
        _check_tensors(locals())  # a non-tensor the schema refused, named as before; any other error as it came
        raise
    return q_c_out


_DS_MLA = ("raw", "pow2")
#: One C++ op (python/csrc/vllm_dropin.cpp), as vLLM registers its own kernel, so torch.compile(fullgraph=True)
#: traces through the function; eager calls go to its C++ entry directly (the OpOverload's Python frame skipped).
_OP = torch.ops.pcpkv_vllm.fused_norm_rope.default
_OP_EAGER = _OP._op
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


@torch.library.register_fake("pcpkv_vllm::fused_norm_rope")
def _(*args, **kwargs):
    """Tracing (FakeTensors): nothing to compute, outputs are caller-provided. The same function is the op's Meta
    kernel, which the dispatcher picks as soon as one argument is a meta tensor: such an eager call goes back to the
    op itself, whose checks name the argument on the wrong device (or, all on meta, write nothing)."""
    if not any(isinstance(a, FakeTensor) for a in args + tuple(kwargs.values())):
        _OP.redispatch(_CPU, *args, **kwargs)
    return None
from .vllm_publish import VLLM_SOURCES, VllmPcpPublisher  # noqa: E402,F401  per-layer publication (vllm_publish.py)
