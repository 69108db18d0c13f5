"""Python entry points of the ``torch.ops.pcpkv`` custom ops, with shapes, dtypes and errors.

Conventions: T = local tokens of this rank (padding included), bf16 activations are the raw projections
(q_a_proj output, kv_a_proj_with_mqa output split into kv [T, 512] and k_pe [T, 64], indexer wk output),
row inner stride 1 (views of a wider projection are fine). Norm weights are float32 (bf16 checkpoint weights
convert exactly; the wrappers convert). Every op runs on CPU tensors (pcpkv's CPU reference, bit-exact
oracle) and CUDA tensors (asynchronous on the current stream, capturable in CUDA graphs). Bad arguments
raise ValueError naming the argument and value before anything is written or launched. On CUDA, slot and
position *values* are not read on the host (that would synchronize) and pcpkv's kernels trust them (as in the
C++ library, pcpkv/publish/kernels.h): they must be in range, which validate_slots() checks on demand.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import torch

from .model_spec import CacheFormat, RopeSpec, check_cache_format
from .tables import CacheTargets, FenceState, RowDests, check_targets

__all__ = ["rope_table", "dispatch", "combine", "insert", "fence", "validate_slots", "cuda_dispatch_impl"]

Tensor = torch.Tensor
#: The most positions rope_table() builds (python/csrc/rope_table.cpp kMaxRopeTablePositions): a 64 GiB table.
MAX_ROPE_POSITIONS = 1 << 28


def rope_table(rope: RopeSpec, num_positions: int, device=None) -> Tensor:
    """cos/sin table float32 [num_positions, 64] = per position [cos(pos*f'_0..31) | sin(pos*f'_0..31)] *
    mscale (SPEC section 1), computed in long double and rounded once (pcpkv::make_rope_table).
    Raises ValueError naming the argument if num_positions is not an integer in [1, 2^28] (256 B of host
    memory per position; 2^40 gave std::bad_alloc) or `rope` is not a RopeSpec (whose values RopeSpec and
    the op check: rope_theta <= 0 gave NaN rows)."""
    if isinstance(num_positions, bool) or not isinstance(num_positions, int) or not 1 <= num_positions <= MAX_ROPE_POSITIONS:
        raise ValueError(f"rope_table: num_positions = {num_positions!r} must be an integer in [1, 2^28]")
    if not isinstance(rope, RopeSpec):
        raise ValueError(f"rope_table: rope must be a RopeSpec, got {type(rope).__name__}")
    t = torch.ops.pcpkv.rope_table(num_positions, rope.scaling, rope.theta, rope.factor,
                                   rope.original_max_position_embeddings, rope.beta_fast, rope.beta_slow, rope.mscale,
                                   rope.mscale_all_dim)
    return t if device is None else t.to(device)


def _f32(w: Optional[Tensor], name: str) -> Optional[Tensor]:
    """A norm weight as float32 (bf16 / fp16 convert exactly, float64 rounds); ValueError naming the argument for a
    non-tensor or a non-floating dtype (an integer weight was cast silently, a complex one lost its imaginary part)."""
    if w is None:
        return None
    if isinstance(w, Tensor) and w.dtype is torch.float32 and w.is_contiguous():
        return w  # what .to() and .contiguous() return for it, without their two dispatcher calls (~0.9 us a weight)
    if not isinstance(w, Tensor) or not w.is_floating_point():
        got = f"{w.dtype} {list(w.shape)} on {w.device}" if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"dispatch: {name}: expected a floating-point weight (float32, bfloat16, ...), got {got}")
    return w.to(torch.float32).contiguous()


def _check_scalars(who: str, reals: dict, flags: dict) -> None:
    """ValueError naming the argument and value for a float argument that is not a real number (a bool is not one) or
    a flag that is not a bool: the op's schema raised a RuntimeError ("Expected a value of type 'float' for argument
    'q_eps' but instead found type 'str'"), or took 1 for True."""
    for name, v in reals.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{who}: {name} = {v!r} must be a float")
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"{who}: {name} = {v!r} must be True or False")


def dispatch(kv: Tensor, k_pe: Tensor, positions: Tensor, kv_norm_w: Tensor, rope_cos_sin: Tensor, *,
             fmt: CacheFormat, q_c: Optional[Tensor] = None, q_norm_w: Optional[Tensor] = None,
             index_k: Optional[Tensor] = None, index_ln_w: Optional[Tensor] = None,
             index_ln_b: Optional[Tensor] = None, slot_mapping: Optional[Tensor] = None,
             targets: Optional[CacheTargets] = None, row_dests: Optional[RowDests] = None,
             q_c_out: Optional[Tensor] = None, kv_c_out: Optional[Tensor] = None, k_pe_out: Optional[Tensor] = None,
             index_k_out: Optional[Tensor] = None, topk_fill: Optional[Tensor] = None, q_eps: float = 1e-6,
             kv_eps: float = 1e-6, index_eps: float = 1e-6, mla_rope_interleaved: bool = True,
             index_rope_interleaved: bool = False, index_hadamard: bool = False,
             written: Sequence[Tensor] = (), topk_fill_mode: str = "full",
             topk_indexer_rows: Optional[int] = None, indexer_slot_mapping: Optional[Tensor] = None) -> None:
    """The fused dispatch (SPEC section 2) of T local tokens, dual-mode: any combination of
      * materialize: q_c_out [T, q_lora_rank] bf16 = RMSNorm(q_c); kv_c_out [T, 512], k_pe_out [T, 64],
        index_k_out [T, 128] bf16 (normalized / roped, the "collect" path); topk_fill int32 [T, width] = -1
        on the rows topk_fill_mode picks: "full" every row (what engines do, the default), "tail" only rows
        t >= topk_indexer_rows, "none" no row (pcpkv/publish/dispatch.h TopkFill). tail is exact when pcpkv's
        indexer_topk with topk = width then runs on rows [0, topk_indexer_rows) of the same buffer: it writes
        every entry of every row it processes (its -1 tail and request -1 rows included), so only the rows
        past the step's tokens are left to the fill;
      * cache writes ("direct"): every token with slot_mapping[t] >= 0 writes its fmt row into every replica
        of `targets` (CacheTargets; MLA row + indexer slot);
      * transport rows ("staging"): token t's packed row (fmt.row_bytes bytes) goes to every destination of
        `row_dests` (RowDests) at offset t * row_bytes, padding rows included.

    Inputs: kv bf16 [T, 512], k_pe bf16 [T, 64], positions int64 [T] (rows of rope_cos_sin),
    kv_norm_w [512], rope_cos_sin float32 [num_positions, 64] (rope_table()), q_c bf16 [T, q_lora_rank]
    (q_lora_rank a multiple of 8, <= 4096) with q_norm_w [q_lora_rank] and q_c_out; index_k bf16 [T, 128]
    with index_ln_w / index_ln_b [128] when fmt.has_indexer; slot_mapping int64 [T] (-1: no cache row);
    indexer_slot_mapping int64 [T] (indexer layers, docs/spec.md 4.2): token t's indexer row goes to its own slot
    indexer_slot_mapping[t] of an indexer cache of its own block count (-1: no indexer row), its MLA row to
    slot_mapping[t]; None (the default): slot_mapping addresses both caches.
    Rope styles: MLA k_pe interleaved pairs (2i, 2i+1) by default; indexer NeoX (i, i+32) for DeepSeek-V3.2,
    interleaved for GLM-5 (ModelSpec.dispatch_kwargs() gives the model's eps and styles). Rotation is in
    place: interleaved output keeps the pair layout (HF transformers emits it de-interleaved, [even | odd]).
    `written`: extra tensors the caller wants declared as mutated (torch.compile ordering).

    Raises ValueError (nothing written) for a bad topk_fill_mode, topk_fill_mode "tail" without
    topk_indexer_rows in [0, T], a wrong dtype/shape/device (every tensor on kv's device, the tables' host copies
    on the CPU, `written` on kv's device type: a meta tensor among real ones is refused by name, not run as the
    op's meta kernel), a norm weight that is not a floating-point tensor (integer, bool and complex weights were
    cast silently), q_c without q_c_out, a q_c width that is not a
    q_lora_rank (zero included: its null data pointer would read as "no Q norm"), an output (q_c_out, kv_c_out,
    k_pe_out, index_k_out, topk_fill) sharing memory with an input, a table or another output, a tensor of
    written + targets.tensors + row_dests.tensors (named written[i] in that order) sharing memory with an input
    or a table (they may repeat each other), a missing indexer input, a bad format, a table whose geometry
    cannot hold fmt's rows, targets that are not a CacheTargets or were built for another format (check_targets: fp8
    rows into fp8_ds_mla caches, raw tile scales into pow2 ones), row_dests that are not a RowDests or whose slots hold
    another row size or too few rows, an eps that is not a float or a rope / hadamard flag that is not a bool, or
    device tables that do not match their host copies; on CPU also for a slot out of range or repeated, or a position
    outside the table. A slot in block 0 is written like any other: the ops do not know whether the engine reserves a
    null block (a plan with reserve_null_block=False uses it); validate_slots(..., null_block_size=block_size) refuses
    it."""
    num_tokens = kv.shape[0] if isinstance(kv, Tensor) and kv.dim() >= 1 else 0
    check_cache_format(fmt, "dispatch")
    check_targets(targets, fmt, "dispatch")
    if row_dests is not None and not isinstance(row_dests, RowDests):
        raise ValueError("dispatch: row_dests must be a RowDests (RowDests.from_staging or from_pointers) or None, "
                         f"got {type(row_dests).__name__}")
    _check_scalars("dispatch", dict(q_eps=q_eps, kv_eps=kv_eps, index_eps=index_eps),
                   dict(mla_rope_interleaved=mla_rope_interleaved, index_rope_interleaved=index_rope_interleaved,
                        index_hadamard=index_hadamard))
    if topk_fill_mode not in ("full", "tail", "none"):
        raise ValueError(f"dispatch: topk_fill_mode = {topk_fill_mode!r} must be 'full', 'tail' or 'none'")
    if topk_fill_mode == "tail":
        if isinstance(topk_indexer_rows, bool) or not isinstance(topk_indexer_rows, int) or \
                not 0 <= topk_indexer_rows <= num_tokens:
            raise ValueError(f"dispatch: topk_indexer_rows = {topk_indexer_rows!r} must be an int in [0, num_tokens = "
                             f"{num_tokens}] for topk_fill_mode 'tail' (the rows the indexer top-k writes)")
    elif topk_indexer_rows is not None:
        raise ValueError(f"dispatch: topk_indexer_rows = {topk_indexer_rows!r} is only used by topk_fill_mode "
                         f"'tail', not {topk_fill_mode!r}")
    if row_dests is not None:
        row_dests.check_capacity(fmt.row_bytes, num_tokens)
    kv_norm_w, q_norm_w = _f32(kv_norm_w, "kv_norm_w"), _f32(q_norm_w, "q_norm_w")
    index_ln_w, index_ln_b = _f32(index_ln_w, "index_ln_w"), _f32(index_ln_b, "index_ln_b")
    torch.ops.pcpkv.dispatch(
        kv, k_pe, positions, kv_norm_w, rope_cos_sin, q_c, q_norm_w, index_k, index_ln_w, index_ln_b, slot_mapping,
        None if targets is None else targets.table, None if targets is None else targets.host,
        None if row_dests is None else row_dests.table, None if row_dests is None else row_dests.host,
        q_c_out, kv_c_out, k_pe_out, index_k_out, topk_fill,
        list(written) + (targets.tensors if targets is not None else []) +
        (row_dests.tensors if row_dests is not None else []),
        fmt.kv_format, fmt.ds_mla_scale, fmt.k_scale, fmt.has_indexer, q_eps, kv_eps, index_eps,
        mla_rope_interleaved, index_rope_interleaved, index_hadamard, topk_fill_mode,
        topk_indexer_rows if topk_indexer_rows is not None else 0, indexer_slot_mapping)


def combine(rows: Tensor, slot_mapping: Tensor, mla_cache: Tensor, index_cache: Optional[Tensor], *,
            fmt: CacheFormat, indexer_slot_mapping: Optional[Tensor] = None) -> None:
    """Staging rows -> this rank's caches (SPEC section 5, "staging"): row i of rows uint8
    [num_src_ranks, max_local_tokens, fmt.row_bytes] (contiguous; staging[buffer, ubatch]) with
    slot_mapping[i] >= 0 (int64 [num_src_ranks * max_local_tokens], the plan's gathered_slot_mapping) is
    copied byte for byte into mla_cache uint8 [num_blocks, block_size, fmt.mla_row_bytes] and, with an
    indexer, index_cache uint8 [num_blocks, block_size, 132]. Raises ValueError on a bad argument (CPU: also a
    slot out of range or repeated), and, naming both, when a cache shares memory with rows, slot_mapping or the
    other cache (by address range; checked before anything is written, on every device). indexer_slot_mapping
    (int64, slot_mapping's shape; None: slot_mapping): the indexer parts' own gathered slots (docs/spec.md 4.2)."""
    check_cache_format(fmt, "combine")
    torch.ops.pcpkv.combine(rows, slot_mapping, mla_cache, index_cache, fmt.kv_format, fmt.ds_mla_scale, fmt.k_scale,
                            fmt.has_indexer, indexer_slot_mapping)


def insert(kv_c: Tensor, k_pe: Tensor, index_k: Optional[Tensor], slot_mapping: Tensor, mla_cache: Tensor,
           index_cache: Optional[Tensor], *, fmt: CacheFormat, indexer_slot_mapping: Optional[Tensor] = None) -> None:
    """Collect path (SPEC section 5): quantize-and-insert gathered bf16 rows kv_c [N, 512], k_pe [N, 64],
    index_k [N, 128] (None when the layer has no indexer; fmt.has_indexer must agree), contiguous, with
    slot_mapping int64 [N], into the caches (shapes as in combine). Quantizes from the bf16 values, so the
    bytes differ from the fused path's (each has its own CPU reference). Raises ValueError on a bad argument, and,
    naming both, when a cache shares memory with an input or the other cache (as combine). indexer_slot_mapping: as
    combine's."""
    check_cache_format(fmt, "insert")
    if (index_k is not None) != fmt.has_indexer:
        raise ValueError(f"insert: index_k is {'given' if index_k is not None else 'missing'} but "
                         f"fmt.has_indexer = {fmt.has_indexer}")
    torch.ops.pcpkv.insert(kv_c, k_pe, index_k, slot_mapping, mla_cache, index_cache, fmt.kv_format,
                           fmt.ds_mla_scale, fmt.k_scale, indexer_slot_mapping)


def fence(state: FenceState, barrier_idx: int = 0, *, timeout_us: int = 10_000_000,
          written: Sequence[Tensor] = ()) -> None:
    """The SPEC section 5 fence for the ranks `state` hosts: e = ++epoch (on the device), release-store e into
    every peer's pad slot [barrier_idx][e & 1][my_rank], then acquire-poll the own slots until all W ranks
    arrived. After it, everything any rank wrote before its fence is visible. One call may host several
    ranks (W logical ranks on one GPU: one block each, co-resident).

    A wait longer than timeout_us ends the wait: on CUDA the kernel records the missing rank in state.error
    (state.check() raises RuntimeError after synchronizing; graph replays keep running), on CPU it raises
    RuntimeError at once. `written`: tensors peers wrote before the fence (declared mutated so torch.compile
    keeps later reads after it). Raises ValueError for a bad barrier_idx, timeout_us (an int in [1, one day in
    us]; a bool is not one) or state."""
    for name, v in (("barrier_idx", barrier_idx), ("timeout_us", timeout_us)):
        # True ran barrier 1 / a 1 us wait; 2**63 raised a RuntimeError of the schema's int64 conversion
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not -2**63 <= v < 2**63:
            raise ValueError(f"fence: {name} = {v!r} must be an int64 integer (not a bool)")
    torch.ops.pcpkv.fence(state.pad_table, state.epochs, state.claim, state.error, state.first_rank, state.world,
                          state.num_barriers, barrier_idx, timeout_us, list(written) + state.pads)


def validate_slots(slot_mapping: Tensor, num_slots: int, name: str = "slot_mapping", null_block_size: int = 0):
    """Host check (synchronizes when slot_mapping is on a GPU; not inside a graph capture): every entry -1 or
    in [0, num_slots), none repeated, none in the null block [0, null_block_size). Raises ValueError naming
    the first bad entry, and for a slot_mapping that is not an int64 [T] tensor (the ops' dtype: float slots 0.5, 1.5
    passed the range checks), and naming num_slots / null_block_size unless they are integers with
    0 <= null_block_size <= num_slots (num_slots = -1 blamed the first slot)."""
    for arg, v in (("num_slots", num_slots), ("null_block_size", null_block_size)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"validate_slots: {arg} = {v!r} must be an integer >= 0")
    if null_block_size > num_slots:
        raise ValueError(f"validate_slots: null_block_size = {null_block_size} exceeds num_slots = {num_slots}")
    if not isinstance(slot_mapping, Tensor) or slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        got = (f"{slot_mapping.dtype} {list(slot_mapping.shape)}" if isinstance(slot_mapping, Tensor)
               else type(slot_mapping).__name__)
        raise ValueError(f"{name}: expected an int64 [num_tokens] tensor, got {got}")
    s = slot_mapping.detach().to("cpu").tolist()
    seen = {}
    for i, v in enumerate(s):
        if v == -1:
            continue
        if v < 0 or v >= num_slots:
            raise ValueError(f"{name}[{i}] = {v} is out of range [0, {num_slots})")
        if v < null_block_size:
            raise ValueError(f"{name}[{i}] = {v} is in the null block [0, {null_block_size})")
        if v in seen:
            raise ValueError(f"{name}[{i}] = {v} duplicates {name}[{seen[v]}]")
        seen[v] = i


def cuda_dispatch_impl() -> str:
    """Which CUDA kernels the ops run: "pcpkv" (pcpkv's own launchers of pcpkv/publish/kernels.h, the kernels the
    C++ library runs; PCPKV_DISPATCH_VARIANT=simple|prefetch|warp|warp_pf|warp_token|warp_split picks the dispatch
    kernel variant, unset or empty the default warp, and any other value, "auto" included, makes the CUDA dispatch raise ValueError) or
    "none" in a CPU-only build."""
    if not hasattr(torch.ops.pcpkv, "cuda_dispatch_impl"):
        return "none"
    return torch.ops.pcpkv.cuda_dispatch_impl()
