"""Cache layout helpers (SPEC section 3): allocate, view and dequantize the paged caches as uint8 tensors.

Shapes (all caches are uint8, inner stride 1, real strides honoured, padding allowed):
  MLA cache       [num_blocks, block_size, row_bytes]   row_bytes 1152 (bf16) | 576 (fp8) | 656 (fp8_ds_mla)
  indexer cache   [num_blocks, block_size, 132]          bytes of a block: block_size rows of 128 e4m3, then
                                                         block_size fp32 UE8M0 scales (not interleaved per token)
  staging         [2, num_ubatches, pcp_world, max_local_tokens, row_bytes]   (SPEC section 3)
Dequantization is exact pcpkv decode math (e4m3 -> fp32, one fp32 multiply by the scale), pure torch, so it
traces under torch.compile and runs on any device.
"""

from __future__ import annotations

import numbers

import torch

from .model_spec import MLA_ROW_BYTES, CacheFormat, scale_problem

__all__ = [
    "allocate_mla_cache",
    "allocate_indexer_cache",
    "allocate_staging",
    "mla_cache_view",
    "indexer_cache_view",
    "dequantize_mla",
    "dequantize_indexer",
]


def _check_ints(fill=None, **counts) -> None:
    """ValueError naming the argument for a count that is not an integer >= 0 (a bool is not one: block_size=True
    made one-slot blocks) or a fill that is not a byte value (fill=-1 filled 255, fill=1.5 filled 1)."""
    for name, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"{name} = {v!r} must be an integer >= 0")
    if fill is not None and (isinstance(fill, bool) or not isinstance(fill, numbers.Integral) or not 0 <= fill <= 255):
        raise ValueError(f"fill = {fill!r} must be a byte value (an integer in [0, 255]) or None")


def block_size_problem(block_size: int) -> str | None:
    """Why an integer block_size cannot be a paged cache's, or None: the CLI's --block-size rule
    (pcpkv::block_size_problem of pcpkv/core/block_size.h, through torch.ops.pcpkv.block_size_problem): a power of two
    >= 4, whose indexer-K cache block (block_size * 132 bytes) is a multiple of 16. 1 and 2 were taken and refused
    later, by the cache table, without the argument's name. The text starts with "must be"; callers name the value."""
    if not -2**63 <= block_size < 2**63:
        return "must be an int64 power of two >= 4"
    return torch.ops.pcpkv.block_size_problem(int(block_size)) or None  # int: a numpy integer is not an op int


def check_block_size(block_size, who: str = "") -> None:
    """Raises ValueError naming `block_size` and its value (after `who`, e.g. "allocate_mla_cache: ") unless it is an
    integer (not a bool) for which block_size_problem() is None."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise ValueError(f"{who}block_size = {block_size!r} must be an integer")
    if why := block_size_problem(block_size):
        raise ValueError(f"{who}block_size = {block_size} {why}")


def _padded(shape_inner: int, num_blocks: int, block_size: int, row_stride: int, block_stride: int, device,
            fill) -> torch.Tensor:
    flat = torch.empty(max(num_blocks * block_stride, 1), dtype=torch.uint8, device=device)
    if fill is not None:
        flat.fill_(fill)
    return flat.as_strided((num_blocks, block_size, shape_inner), (block_stride, row_stride, 1))


def allocate_mla_cache(num_blocks: int, block_size: int, kv_format: str, device=None, *, row_pad: int = 0,
                       block_pad: int = 0, fill: int | None = None) -> torch.Tensor:
    """Paged MLA cache: uint8 [num_blocks, block_size, row_bytes(kv_format)] with row stride
    row_bytes + row_pad and block stride block_size * row stride + block_pad (bytes).

    fill: byte to initialize every byte with (None: uninitialized). Raises ValueError on an unknown format,
    a block_size that is not a power of two >= 4 (check_block_size, the CLI's --block-size rule), pads that break
    4-byte alignment of the fp32 scales, a count that is not an integer >= 0 or a fill that is not a byte value."""
    _check_ints(fill, num_blocks=num_blocks, block_size=block_size, row_pad=row_pad, block_pad=block_pad)
    if kv_format not in MLA_ROW_BYTES:
        raise ValueError(f"kv_format = {kv_format!r}; expected one of {sorted(MLA_ROW_BYTES)}")
    check_block_size(block_size, "allocate_mla_cache: ")
    if row_pad % 4 or block_pad % 4 or row_pad < 0 or block_pad < 0:
        raise ValueError(f"row_pad = {row_pad}, block_pad = {block_pad} must be non-negative multiples of 4")
    row = MLA_ROW_BYTES[kv_format]
    row_stride = row + row_pad
    return _padded(row, num_blocks, block_size, row_stride, block_size * row_stride + block_pad, device, fill)


def allocate_indexer_cache(num_blocks: int, block_size: int, device=None, *, block_pad: int = 0,
                           fill: int | None = None) -> torch.Tensor:
    """Indexer-K cache (vLLM DeepseekV32IndexerCache): uint8 [num_blocks, block_size, 132] with block stride
    block_size * 132 + block_pad bytes. Raises ValueError on a bad block_size (check_block_size), block_pad, num_blocks
    or fill."""
    _check_ints(fill, num_blocks=num_blocks, block_size=block_size, block_pad=block_pad)
    check_block_size(block_size, "allocate_indexer_cache: ")
    if block_pad % 4 or block_pad < 0:
        raise ValueError(f"block_pad = {block_pad} must be a non-negative multiple of 4")
    return _padded(132, num_blocks, block_size, 132, block_size * 132 + block_pad, device, fill)


def allocate_staging(pcp_world: int, max_local_tokens: int, fmt: CacheFormat, device=None, *,
                     num_ubatches: int = 1, fill: int | None = None) -> torch.Tensor:
    """Staging workspace of one rank (SPEC section 3): uint8 [2, num_ubatches, pcp_world, max_local_tokens,
    fmt.row_bytes]. staging[buffer, ubatch] is the rows argument of pcpkv_torch.combine. Raises ValueError for a
    count that is not an integer >= 0 or a fill that is not a byte value."""
    _check_ints(fill, pcp_world=pcp_world, max_local_tokens=max_local_tokens, num_ubatches=num_ubatches)
    t = torch.empty((2, num_ubatches, pcp_world, max_local_tokens, fmt.row_bytes), dtype=torch.uint8, device=device)
    if fill is not None:
        t.fill_(fill)
    return t


def _check_mla(cache: torch.Tensor, kv_format: str):
    row = MLA_ROW_BYTES.get(kv_format)
    if row is None:
        raise ValueError(f"kv_format = {kv_format!r}; expected one of {sorted(MLA_ROW_BYTES)}")
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != row or cache.stride(2) != 1:
        raise ValueError(f"mla cache: expected uint8 [num_blocks, block_size, {row}] ({kv_format}) with unit inner "
                         f"stride, got {cache.dtype} {list(cache.shape)} strides {cache.stride()}")


def mla_cache_view(cache: torch.Tensor, kv_format: str) -> dict:
    """Typed views (no copy) of an MLA cache uint8 [num_blocks, block_size, row_bytes]:
      bf16:        {"kv_c": bf16 [nb, bs, 512], "k_pe": bf16 [nb, bs, 64]}
      fp8:         {"kv_c": float8_e4m3fn [nb, bs, 512], "k_pe": float8_e4m3fn [nb, bs, 64]}
      fp8_ds_mla:  {"kv_c": float8_e4m3fn [nb, bs, 512], "tile_scales": fp32 [nb, bs, 4], "k_pe": bf16 [nb, bs, 64]}
    Raises ValueError on a bad cache or format (and RuntimeError from torch when strides are not multiples of
    the element size)."""
    _check_mla(cache, kv_format)
    if kv_format == "bf16":
        return {"kv_c": cache[..., :1024].view(torch.bfloat16), "k_pe": cache[..., 1024:1152].view(torch.bfloat16)}
    if kv_format == "fp8":
        return {"kv_c": cache[..., :512].view(torch.float8_e4m3fn), "k_pe": cache[..., 512:576].view(torch.float8_e4m3fn)}
    return {
        "kv_c": cache[..., :512].view(torch.float8_e4m3fn),
        "tile_scales": cache[..., 512:528].view(torch.float32),
        "k_pe": cache[..., 528:656].view(torch.bfloat16),
    }


def indexer_cache_view(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data float8_e4m3fn [nb, bs, 128], scales fp32 [nb, bs]) views of an indexer cache uint8
    [num_blocks, block_size, 132] (SPEC section 3 byte order within each block). Raises ValueError."""
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != 132 or cache.stride(2) != 1 or (
            cache.shape[1] > 1 and cache.stride(1) != 132):
        raise ValueError(f"indexer cache: expected uint8 [num_blocks, block_size, 132], got {cache.dtype} "
                         f"{list(cache.shape)} strides {cache.stride()}")
    nb, bs, _ = cache.shape
    block_stride = cache.stride(0) if nb > 1 else bs * 132
    off = cache.storage_offset()
    data = cache.as_strided((nb, bs, 128), (block_stride, 128, 1), off).view(torch.float8_e4m3fn)
    scales = cache.as_strided((nb, bs, 4), (block_stride, 4, 1), off + bs * 128).view(torch.float32)[..., 0]
    return data, scales


def _slots(slots, num_slots: int, device, who: str):
    """slots as an int64 [N] tensor on `device` (None stays None: every slot). ValueError naming `who`'s slots for a
    float, complex or bool tensor (slot 1.7 read as 1), one of more than one dimension, or an entry outside
    [0, num_slots) (index_select's IndexError named neither; checked on the host, so not while torch.compile traces)."""
    if slots is None:
        return None
    slots = torch.as_tensor(slots, device=device)
    if slots.numel() and (slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool):  # 1.7: slot 1
        raise ValueError(f"{who}: slots: expected integer slot indices, got {slots.dtype}")
    if slots.dim() > 1:
        raise ValueError(f"{who}: slots: expected a 1-d sequence of slots, got shape {list(slots.shape)}")
    slots = slots.reshape(-1).to(torch.long)
    if slots.numel() and not torch.compiler.is_compiling():
        bad = ((slots < 0) | (slots >= num_slots)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"{who}: slots[{i}] = {int(slots[i])} is out of range [0, {num_slots}) (the cache's "
                             "num_blocks * block_size)")
    return slots


def _select(x: torch.Tensor, slots) -> torch.Tensor:
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return flat if slots is None else flat.index_select(0, slots)


def dequantize_mla(cache: torch.Tensor, kv_format: str, k_scale: float = 1.0, slots=None):
    """Decoded (kv_c fp32 [N, 512], k_pe fp32 [N, 64]) of an MLA cache, N = len(slots) (or every slot,
    num_blocks * block_size, when slots is None). The values are exactly pcpkv's decode (pcpkv/publish/checks.h
    decode_slot): bf16 -> fp32; fp8: e4m3 * k_scale; fp8_ds_mla: e4m3 * tile scale, k_pe bf16. Raises ValueError
    for an fp8 k_scale that pcpkv's writers refuse (nan, 0, ...: every value came back nan or 0), and naming the entry
    for slots that are not integers or lie outside [0, num_blocks * block_size)."""
    if kv_format == "fp8" and (why := scale_problem(k_scale)):
        raise ValueError(f"dequantize_mla: k_scale = {k_scale!r} {why}")
    v = mla_cache_view(cache, kv_format)
    slots = _slots(slots, cache.shape[0] * cache.shape[1], cache.device, "dequantize_mla")
    kv_c = _select(v["kv_c"], slots).float()
    k_pe = _select(v["k_pe"], slots).float()
    if kv_format == "fp8":
        return kv_c * k_scale, k_pe * k_scale
    if kv_format == "fp8_ds_mla":
        s = _select(v["tile_scales"], slots)
        kv_c = (kv_c.view(-1, 4, 128) * s.unsqueeze(-1)).view(-1, 512)
    return kv_c, k_pe


def dequantize_indexer(cache: torch.Tensor, slots=None) -> torch.Tensor:
    """Decoded indexer K fp32 [N, 128] = e4m3 * the slot's UE8M0 scale (N and the slots' checks as in
    dequantize_mla)."""
    data, scales = indexer_cache_view(cache)
    slots = _slots(slots, cache.shape[0] * cache.shape[1], cache.device, "dequantize_indexer")
    return _select(data, slots).float() * _select(scales, slots).unsqueeze(-1)
