"""Pointer tables the ops write through: cache replicas (direct), staging slots (staging), fence pads.

Build them once at setup (they hold a host copy for validation and a device copy for the kernels), then
pass them to every call; they stay valid while the memory they point to lives. Pointers can come from
local tensors (W logical ranks in one process), from pcpkv's own symmetric memory
(pcpkv::SymmetricMemory::ptrs()), or from PyTorch symmetric memory handles
(``torch.distributed._symmetric_memory.rendezvous(t, group).buffer_ptrs``): see peer_pointers().
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .model_spec import CacheFormat, check_cache_format, written_fields

__all__ = ["CacheTargets", "RowDests", "FenceState", "allocate_fence_pads", "check_targets", "peer_pointers",
           "pointer_table"]


def pointer_table(ptrs: Iterable[int], device=None) -> torch.Tensor:
    """int64 [n] tensor of raw addresses (uint64 bit patterns) on `device`."""
    vals = [int(p) for p in ptrs]
    vals = [v - (1 << 64) if v >= (1 << 63) else v for v in vals]
    return torch.tensor(vals, dtype=torch.int64, device=device)


def peer_pointers(handle, offset_bytes: int = 0) -> list[int]:
    """Every rank's address of a symmetric buffer plus offset_bytes, from a PyTorch symmetric-memory handle
    (anything with ``buffer_ptrs``, e.g. ``torch.distributed._symmetric_memory.rendezvous(t, group)``) or
    pcpkv's own (anything with ``ptrs``), or a plain sequence of ints. Index r is rank r's buffer as mapped
    in this process."""
    if hasattr(handle, "buffer_ptrs"):
        base = list(handle.buffer_ptrs)
    elif hasattr(handle, "ptrs"):
        base = list(handle.ptrs() if callable(handle.ptrs) else handle.ptrs)
    else:
        base = list(handle)
    return [int(p) + offset_bytes for p in base]


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)} strides {list(t.stride())} on {t.device}"


def first_overlap(writes: Sequence[tuple], reads: Sequence[tuple] = ()):
    """The first pair ((name, tensor), (name, tensor)) of a tensor of `writes` and another of `writes` or one of
    `reads` (each a sequence of (name, tensor or None)) whose memory overlaps, or None. Overlap is of the
    tensors' byte extents by address (pcpkv::first_overlap of pcpkv/core/byte_range.h, the ops' own check): a
    view of another storage over the same memory counts; reads are not compared with each other."""
    writes = [(n, t) for n, t in writes if t is not None]
    reads = [(n, t) for n, t in reads if t is not None]
    hit = torch.ops.pcpkv.first_overlap([t for _, t in writes], [t for _, t in reads], True)
    return (writes[hit[0]], (writes + reads)[hit[1]]) if hit else None


def _refuse_overlapping(what: str, entries: Sequence[tuple]) -> None:
    """ValueError naming the first two of `entries` ((name, address, size in bytes): the entries of one pointer
    table) whose byte ranges overlap. The check is pcpkv::first_overlap on address ranges, the ops' own."""
    hit = torch.ops.pcpkv.first_range_overlap(pointer_table([p for _, p, _ in entries]), [n for _, _, n in entries])
    if hit:
        (a, pa, na), (b, pb, nb) = entries[hit[0]], entries[hit[1]]
        raise ValueError(f"{what}: {a} = {pa:#x} ({na} B) overlaps {b} = {pb:#x} ({nb} B): every entry is written "
                         "through, so no two may share memory")


def _mla_geometry(cache, fmt: CacheFormat, name: str) -> tuple:
    """(num_blocks, block_size, row_stride, block_stride) in bytes that a dispatch writes through for an MLA
    cache uint8 [num_blocks, block_size, fmt.mla_row_bytes] (unit inner stride, rows and blocks not
    overlapping). The tensor's extent covers every byte of every slot, so equal geometry means no overrun."""
    row = fmt.mla_row_bytes
    if (not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 3 or
            cache.shape[2] != row or cache.stride(2) != 1):
        raise ValueError(f"{name}: expected a uint8 [num_blocks, block_size, {row}] {fmt.kv_format} cache with unit "
                         f"inner stride, got {_describe(cache)}")
    nb, bs = cache.shape[0], cache.shape[1]
    if nb < 1 or bs < 1:
        raise ValueError(f"{name}: an empty cache ({_describe(cache)})")
    row_stride = cache.stride(1) if bs > 1 else row  # a lone row's stride is never used
    block_stride = cache.stride(0) if nb > 1 else bs * row_stride
    if row_stride < row or block_stride < bs * row_stride:
        raise ValueError(f"{name}: rows or blocks overlap ({_describe(cache)}: row stride {row_stride} < {row} or "
                         f"block stride {block_stride} < {bs} * {row_stride})")
    return nb, bs, row_stride, block_stride


def _index_geometry(cache, name: str) -> tuple:
    """(num_blocks, block_size, block_stride) in bytes of an indexer cache uint8 [num_blocks, block_size, 132]
    whose block holds block_size rows of 128 bytes then block_size 4-byte scales (SPEC section 3)."""
    if (not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 3 or
            cache.shape[2] != 132 or cache.stride(2) != 1 or (cache.shape[1] > 1 and cache.stride(1) != 132)):
        raise ValueError(f"{name}: expected a uint8 [num_blocks, block_size, 132] indexer cache (the rows of a block "
                         f"contiguous), got {_describe(cache)}")
    nb, bs = cache.shape[0], cache.shape[1]
    if nb < 1 or bs < 1:
        raise ValueError(f"{name}: an empty cache ({_describe(cache)})")
    block_stride = cache.stride(0) if nb > 1 else bs * 132
    if block_stride < bs * 132:
        raise ValueError(f"{name}: blocks overlap ({_describe(cache)}: block stride {block_stride} < {bs} * 132)")
    return nb, bs, block_stride


def _check_same(tensors: Sequence, name: str, geometry_of) -> None:
    """Every tensor has the geometry (geometry_of(t, name)) and device of tensors[0]: ValueError naming the
    first that differs."""
    first = geometry_of(tensors[0], f"{name}[0]")
    for i, t in enumerate(tensors[1:], 1):
        if geometry_of(t, f"{name}[{i}]") != first or t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] ({_describe(t)}) differs from {name}[0] ({_describe(tensors[0])}): every "
                             f"replica needs the geometry and device of the first (the table records one)")


def _pointers(ptrs, name: str) -> list[int]:
    """ptrs as a non-empty list of non-null ints (ValueError naming the argument otherwise)."""
    if ptrs is None or isinstance(ptrs, (str, bytes, torch.Tensor)):
        raise ValueError(f"{name}: expected a sequence of addresses (ints), got {type(ptrs).__name__}")
    vals = list(ptrs)
    if not vals:
        raise ValueError(f"{name} is empty; expected one address per replica / rank")
    for i, v in enumerate(vals):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < (1 << 64):
            raise ValueError(f"{name}[{i}] = {v!r} is not a non-null address")
    return vals


class CacheTargets:
    """Cache replicas a dispatch writes final rows into ("direct"): a table of pcpkv::CacheTarget records,
    host copy `host` (CPU uint8 [D, 72]) and device copy `table`. All replicas share one geometry.
    `tensors` are the local tensors behind the pointers (declared as mutated to torch.compile). `fmt`: the
    CacheFormat the caches were laid out for (from_caches / from_pointers record theirs; None: unknown, a table built
    by hand): a dispatch refuses another format's rows (check_targets), which the records cannot tell apart (an fp8
    row fits a 656-byte fp8_ds_mla slot; pow2 and raw tile scales are the same size)."""

    def __init__(self, host: torch.Tensor, table: torch.Tensor, tensors: Sequence[torch.Tensor] = (),
                 fmt: CacheFormat | None = None):
        self.host = host
        self.table = table
        self.tensors = list(tensors)
        self.fmt = fmt

    def __len__(self):
        return self.host.shape[0]

    @staticmethod
    def from_pointers(mla_ptrs: Sequence[int], index_ptrs: Sequence[int] | None, *, like_mla: torch.Tensor,
                      like_index: torch.Tensor | None, fmt: CacheFormat, device=None,
                      tensors: Sequence[torch.Tensor] = ()) -> "CacheTargets":
        """Targets at raw addresses (peers' replicas), each with the geometry of the local replicas like_mla
        (uint8 [num_blocks, block_size, fmt.mla_row_bytes]) and like_index (uint8 [num_blocks, block_size, 132]):
        the memory at every address must be at least that large (pcpkv cannot check a raw address). The table
        lives on `device` (default: like_mla's), which must be of like_mla's device type.
        Raises ValueError naming the argument when a geometry cannot hold fmt's rows, the two caches' block sizes
        differ (the indexer cache may have its own block count: docs/spec.md 4.2), a pointer list is empty, has a null
        entry or the wrong length, the devices disagree, or two replicas (of those sizes at those addresses, MLA and
        indexer caches alike) overlap, naming both."""
        check_cache_format(fmt, "CacheTargets")
        mla_ptrs = _pointers(mla_ptrs, "CacheTargets: mla_ptrs")
        mla = _mla_geometry(like_mla, fmt, "CacheTargets: like_mla")
        device = like_mla.device if device is None else torch.device(device)
        if device.type != like_mla.device.type:
            raise ValueError(f"CacheTargets: device = {device} but like_mla is on {like_mla.device}: the dispatch "
                             f"on {device} would write through {like_mla.device.type} addresses")
        idx_ptrs, idx_stride, nb = [], 0, mla[0]
        if fmt.has_indexer:
            if like_index is None or index_ptrs is None:
                raise ValueError("CacheTargets: a layer with an indexer (fmt.has_indexer) needs index_ptrs and like_index")
            idx_ptrs = _pointers(index_ptrs, "CacheTargets: index_ptrs")
            if len(idx_ptrs) != len(mla_ptrs):
                raise ValueError(f"CacheTargets: {len(mla_ptrs)} mla_ptrs but {len(idx_ptrs)} index_ptrs")
            nb, bs, idx_stride = _index_geometry(like_index, "CacheTargets: like_index")
            # Its own block count is fine (an indexer slot mapping addresses it, docs/spec.md 4.2; without one, slots
            # are checked against the smaller cache); its block_size is the MLA cache's.
            if bs != mla[1]:
                raise ValueError(f"CacheTargets: indexer cache block_size {bs} differs from the MLA cache's {mla[1]} "
                                 f"(indexer cache [num_blocks, block_size] = {[nb, bs]}, MLA {list(mla[:2])})")
            if like_index.device != like_mla.device:
                raise ValueError(f"CacheTargets: like_index is on {like_index.device} but like_mla on {like_mla.device}")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != device.type:
                raise ValueError(f"CacheTargets: tensors[{i}] ({_describe(t)}) is not a tensor on {device.type}")
        # the bytes a dispatch writes through each record (the geometry's last slot ends there)
        mla_bytes = (mla[0] - 1) * mla[3] + (mla[1] - 1) * mla[2] + fmt.mla_row_bytes
        idx_bytes = (nb - 1) * idx_stride + mla[1] * 132
        _refuse_overlapping("CacheTargets", [(f"mla_ptrs[{i}]", p, mla_bytes) for i, p in enumerate(mla_ptrs)] +
                            [(f"index_ptrs[{i}]", p, idx_bytes) for i, p in enumerate(idx_ptrs)])
        host = torch.ops.pcpkv.make_cache_targets(
            pointer_table(mla_ptrs), pointer_table(idx_ptrs), mla[0], mla[1], mla[2], mla[3], idx_stride,
            fmt.kv_format, fmt.has_indexer, nb)
        return CacheTargets(host, host.to(device), tensors, fmt)

    @staticmethod
    def from_caches(mla_caches: Sequence[torch.Tensor], index_caches: Sequence[torch.Tensor] | None,
                    fmt: CacheFormat) -> "CacheTargets":
        """Targets over local cache tensors (e.g. the W replicas of W logical ranks on one GPU): mla_caches
        uint8 [num_blocks, block_size, fmt.mla_row_bytes] and, when fmt.has_indexer, as many index_caches
        uint8 [num_blocks, block_size, 132] (ignored otherwise). Every replica must have the dtype, shape,
        strides and device of the first of its kind (the table records one geometry; a smaller replica would
        be written past its end), and no two caches may share memory (the same replica twice, an indexer cache
        inside an MLA cache). Raises ValueError naming the argument and index otherwise, or when a list is
        empty."""
        check_cache_format(fmt, "CacheTargets.from_caches")
        if isinstance(mla_caches, torch.Tensor) or not mla_caches:
            raise ValueError("CacheTargets.from_caches: mla_caches must be a non-empty list of MLA caches, got "
                             f"{_describe(mla_caches) if isinstance(mla_caches, torch.Tensor) else mla_caches!r}")
        mla_caches = list(mla_caches)
        _check_same(mla_caches, "CacheTargets.from_caches: mla_caches", lambda c, n: _mla_geometry(c, fmt, n))
        idx = None
        if fmt.has_indexer:
            if index_caches is None or isinstance(index_caches, torch.Tensor) or len(index_caches) != len(mla_caches):
                raise ValueError(f"CacheTargets.from_caches: a layer with an indexer needs one index cache per MLA "
                                 f"cache ({len(mla_caches)}), got "
                                 f"{'None' if index_caches is None else _describe(index_caches) if isinstance(index_caches, torch.Tensor) else len(index_caches)}")
            idx = list(index_caches)
            _check_same(idx, "CacheTargets.from_caches: index_caches", _index_geometry)
            if idx[0].device != mla_caches[0].device:
                raise ValueError(f"CacheTargets.from_caches: index_caches are on {idx[0].device} but mla_caches on "
                                 f"{mla_caches[0].device}")
        hit = first_overlap([(f"mla_caches[{i}]", c) for i, c in enumerate(mla_caches)] +
                            [(f"index_caches[{i}]", c) for i, c in enumerate(idx or [])])
        if hit:
            (a, ta), (b, tb) = hit
            raise ValueError(f"CacheTargets.from_caches: {a} ({_describe(ta)}) shares memory with {b} "
                             f"({_describe(tb)}): a dispatch writes every cache of every replica, so they must not "
                             "overlap")
        return CacheTargets.from_pointers(
            [c.data_ptr() for c in mla_caches], [c.data_ptr() for c in idx] if idx else None, like_mla=mla_caches[0],
            like_index=idx[0] if idx else None, fmt=fmt, tensors=mla_caches + (idx or []))


def check_targets(targets, fmt: CacheFormat, who: str) -> None:
    """The one check of the tables an op writes final cache rows through against the format it writes (dispatch, and
    so VllmPcpPublisher's direct path, EngineCaches' and SymmetricCaches' targets): ValueError naming `targets`
    unless it is None or a CacheTargets, and naming `fmt` and the targets' format when they write different bytes
    (written_fields: an fp8 row written into fp8_ds_mla caches, raw tile scales into pow2 ones), before anything is
    written. A CacheTargets of unknown format (fmt None) is checked by the op's geometry only."""
    if targets is None:
        return
    if not isinstance(targets, CacheTargets):
        raise ValueError(f"{who}: targets must be a CacheTargets (CacheTargets.from_caches or from_pointers) or None, "
                         f"got {_describe(targets)}")
    if targets.fmt is None:
        return
    mine, theirs = written_fields(fmt), written_fields(targets.fmt)
    if mine != theirs:
        # another kv_format: its scale fields are not comparable, the format names say it
        keys = mine if mine["kv_format"] == theirs["kv_format"] else ("kv_format", "has_indexer")
        diff = ", ".join(f"{k} {mine[k]!r} vs {theirs[k]!r}" for k in keys if mine[k] != theirs[k])
        raise ValueError(f"{who}: fmt = {fmt} does not write the format targets were built for, {targets.fmt} "
                         f"({diff}); pass the targets' format, or targets built for fmt")


class RowDests:
    """Where a dispatch stores its transport rows ("staging"): row t goes to dests[d] + t * row_bytes for
    every d. host: CPU int64 [R]; table: its device copy; tensors: local tensors behind the pointers.
    row_bytes / max_rows: the capacity of every destination slot when known (from_staging records it;
    dispatch then refuses a format with other rows or more than max_rows tokens instead of overrunning)."""

    def __init__(self, host: torch.Tensor, table: torch.Tensor, tensors: Sequence[torch.Tensor] = (), *,
                 row_bytes: int | None = None, max_rows: int | None = None):
        self.host = host
        self.table = table
        self.tensors = list(tensors)
        self.row_bytes = row_bytes
        self.max_rows = max_rows

    def __len__(self):
        return self.host.shape[0]

    def check_capacity(self, row_bytes: int, num_rows: int):
        """Raises ValueError when num_rows rows of row_bytes bytes do not fit the recorded slot capacity."""
        if self.row_bytes is not None and row_bytes != self.row_bytes:
            raise ValueError(f"row_dests: the destination slots hold {self.row_bytes} B rows, but this format's rows "
                             f"are {row_bytes} B")
        if self.max_rows is not None and num_rows > self.max_rows:
            raise ValueError(f"row_dests: {num_rows} rows do not fit destination slots of {self.max_rows} rows")

    @staticmethod
    def from_pointers(ptrs: Sequence[int], device, tensors: Sequence[torch.Tensor] = (), *,
                      row_bytes: int | None = None, max_rows: int | None = None) -> "RowDests":
        """Destinations at raw addresses (e.g. peer_pointers() of a symmetric staging buffer) for a dispatch
        on `device`; give row_bytes / max_rows of the slots so that dispatch can check a call against them
        (each address must then hold max_rows * row_bytes bytes; without them nothing can be checked).
        Raises ValueError naming the argument for an empty list, a null address, a row_bytes / max_rows
        that is not a positive integer, or two slots that overlap (each max_rows * row_bytes bytes, an unknown
        factor counting as 1: without them only a repeated address is refused), naming both."""
        vals = _pointers(ptrs, "RowDests: ptrs")
        for name, v in (("row_bytes", row_bytes), ("max_rows", max_rows)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"RowDests: {name} = {v!r} must be a positive integer (or None)")
        slot_bytes = (max_rows or 1) * (row_bytes or 1)  # every destination receives row 0 at least
        _refuse_overlapping("RowDests", [(f"ptrs[{i}]", p, slot_bytes) for i, p in enumerate(vals)])
        device = torch.device(device)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != device.type:
                raise ValueError(f"RowDests: tensors[{i}] ({_describe(t)}) is not a tensor on {device.type}")
        host = pointer_table(vals)
        return RowDests(host, host.to(device), tensors, row_bytes=row_bytes, max_rows=max_rows)

    @staticmethod
    def from_staging(staging: Sequence[torch.Tensor], src_rank: int, *, buffer: int = 0, ubatch: int = 0) -> "RowDests":
        """Rank src_rank's slot in every peer's staging workspace (uint8 [2, U, W, M, row_bytes], see
        allocate_staging): dests[d] = &staging[d][buffer, ubatch, src_rank, 0, 0]. Records row_bytes and M,
        so a dispatch whose rows do not fit is refused. Raises ValueError when staging is empty, a workspace
        is not a contiguous uint8 5-d tensor, the workspaces differ in shape or device, src_rank / buffer /
        ubatch is out of range, or two of the slots overlap (e.g. one workspace listed twice: RowDests: ptrs[i]
        is staging[i]'s slot)."""
        if isinstance(staging, torch.Tensor) or not staging:
            raise ValueError("staging: expected a non-empty list of staging workspaces (one per destination rank), "
                             f"got {_describe(staging) if isinstance(staging, torch.Tensor) else staging!r}")
        first = staging[0]
        for i, s in enumerate(staging):
            if not isinstance(s, torch.Tensor) or s.dim() != 5 or s.dtype != torch.uint8 or not s.is_contiguous():
                raise ValueError(f"staging[{i}]: expected contiguous uint8 [2, U, W, M, row_bytes], got {_describe(s)}")
            if s.shape != first.shape or s.device != first.device:
                raise ValueError(f"staging[{i}]: workspaces differ ({list(s.shape)} on {s.device} vs "
                                 f"{list(first.shape)} on {first.device})")
        for name, v in (("buffer", buffer), ("ubatch", ubatch), ("src_rank", src_rank)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"staging: {name} = {v!r} must be an integer")
        if not (0 <= buffer < first.shape[0] and 0 <= ubatch < first.shape[1] and 0 <= src_rank < first.shape[2]):
            raise ValueError(f"staging: buffer {buffer}, ubatch {ubatch}, src_rank {src_rank} out of range for "
                             f"{list(first.shape)}")
        if first.shape[3] < 1 or first.shape[4] < 1:
            raise ValueError(f"staging: empty slots ({list(first.shape)})")
        ptrs = [s[buffer, ubatch, src_rank].data_ptr() for s in staging]
        return RowDests.from_pointers(ptrs, first.device, staging, row_bytes=first.shape[4], max_rows=first.shape[3])


# A fence barrier is reused once its epoch has passed, so an engine needs one per layer it keeps in flight (a
# model's layer count at most); the cap turns a mistyped count into a named refusal, not a huge pad allocation.
MAX_FENCE_BARRIERS = 4096
#: The most ranks a fence spans (FenceState's bound).
MAX_FENCE_WORLD = 1024


def check_num_barriers(num_barriers, who: str) -> None:
    """Raises ValueError naming `num_barriers` unless it is an integer in [1, MAX_FENCE_BARRIERS]."""
    if isinstance(num_barriers, bool) or not isinstance(num_barriers, int) or \
            not 1 <= num_barriers <= MAX_FENCE_BARRIERS:
        raise ValueError(f"{who}num_barriers = {num_barriers!r} must be an integer in [1, {MAX_FENCE_BARRIERS}]")


def check_world(world, who: str) -> None:
    """Raises ValueError naming `world` unless it is an integer in [1, MAX_FENCE_WORLD]."""
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_FENCE_WORLD:
        raise ValueError(f"{who}world = {world!r} must be an integer in [1, {MAX_FENCE_WORLD}]")


def allocate_fence_pads(world: int, num_barriers: int = 1, device=None) -> list[torch.Tensor]:
    """One zeroed signal pad per rank, int64 [num_barriers, 2, world] (the SPEC section 5 pad of uint64),
    for W logical ranks of one process. Ranks in separate processes put their pad in symmetric memory.
    Raises ValueError naming the argument unless world is an integer in [1, 1024] and num_barriers one in [1, 4096]
    (FenceState's bounds: 5000 barriers and world 0 were allocated, then refused by FenceState without their name)."""
    check_world(world, "allocate_fence_pads: ")
    check_num_barriers(num_barriers, "allocate_fence_pads: ")
    return [torch.zeros((num_barriers, 2, world), dtype=torch.int64, device=device) for _ in range(world)]


class FenceState:
    """Device state of the fence for the ranks [first_rank, first_rank + num_local_ranks) this process hosts:
      pad_table  int64 [world] every rank's pad address (pad = uint64 [num_barriers][2][world], zeroed at setup)
      epochs     int64 [num_local_ranks, num_barriers] device epoch counters (graph replays advance them)
      claim      int32 [1] (CUDA) elects the block that reports a timeout
      error      pinned uint8 [32] pcpkv::FenceError written on a timeout (read it with check())
    `pads` are local pad tensors (declared as mutated to torch.compile)."""

    FLAG = 0xFE0CE001

    def __init__(self, pad_ptrs: Sequence[int], *, world: int, num_barriers: int = 1, first_rank: int = 0,
                 num_local_ranks: int = 1, device=None, pads: Sequence[torch.Tensor] = ()):
        """pad_ptrs[r]: rank r's pad address (as mapped here; 8-byte aligned, num_barriers * 2 * world int64).
        Raises ValueError naming the argument for a count that is not a positive integer, hosted ranks
        outside [0, world), a null or misaligned address, two pads that share memory (naming both: a rank's
        signal would land in another rank's slots), or a pad tensor that is not a contiguous int64
        [num_barriers, 2, world] on the fence's device type."""
        check_num_barriers(num_barriers, "FenceState: ")
        check_world(world, "FenceState: ")
        for name, v, lo in (("first_rank", first_rank, 0), ("num_local_ranks", num_local_ranks, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"FenceState: {name} = {v!r} must be an integer >= {lo}")
        if first_rank + num_local_ranks > world:
            raise ValueError(f"FenceState: ranks [{first_rank}, {first_rank + num_local_ranks}) are not inside "
                             f"[0, world = {world})")
        pad_ptrs = _pointers(pad_ptrs, "FenceState: pad_ptrs")
        if len(pad_ptrs) != world:
            raise ValueError(f"FenceState: {len(pad_ptrs)} pad pointers for world = {world}")
        for r, p in enumerate(pad_ptrs):
            if p % 8:
                raise ValueError(f"FenceState: pad_ptrs[{r}] = {p:#x} is not 8-byte aligned")
        _refuse_overlapping("FenceState", [(f"pad_ptrs[{r}]", p, num_barriers * 2 * world * 8)
                                           for r, p in enumerate(pad_ptrs)])
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.world, self.num_barriers, self.first_rank = world, num_barriers, first_rank
        self.pads = list(pads)
        for i, p in enumerate(self.pads):
            # the fence writes through the pad pointers on this device: CPU code must never get device pads,
            # and a smaller pad would be written past its end
            if (not isinstance(p, torch.Tensor) or p.dtype not in (torch.int64, torch.uint64) or
                    tuple(p.shape) != (num_barriers, 2, world) or not p.is_contiguous()):
                raise ValueError(f"FenceState: pads[{i}]: expected a contiguous int64 [num_barriers={num_barriers}, 2, "
                                 f"world={world}], got {_describe(p)}")
            if p.device.type != device.type:
                raise ValueError(f"FenceState: a pad on {p.device} for a fence on {device}")
        self.pad_table = pointer_table(pad_ptrs, device if device.type == "cuda" else None)
        self.epochs = torch.zeros((num_local_ranks, num_barriers), dtype=torch.int64, device=device)
        self.claim = torch.zeros(1, dtype=torch.int32, device=device)
        self.error = torch.zeros(32, dtype=torch.uint8, pin_memory=device.type == "cuda")

    @staticmethod
    def local(pads: Sequence[torch.Tensor], num_barriers: int | None = None) -> "FenceState":
        """All W ranks hosted by this process (one fence call serves them all), over allocate_fence_pads().
        num_barriers: None (the default) takes the pads' own (pads[0].shape[0]; it was 1, and pads of 5 barriers were
        refused as "expected [num_barriers=1, ...]"). Raises ValueError when pads is empty or a pad is not int64
        [num_barriers, 2, W] (see __init__)."""
        if isinstance(pads, torch.Tensor) or not pads:
            raise ValueError("FenceState.local: pads must be a non-empty list of pads (allocate_fence_pads), got "
                             f"{_describe(pads) if isinstance(pads, torch.Tensor) else pads!r}")
        for i, p in enumerate(pads):
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"FenceState: pads[{i}] is a {type(p).__name__}, not a tensor")
        if num_barriers is None:
            num_barriers = pads[0].shape[0] if pads[0].dim() == 3 else 1  # another shape: __init__ names the pad
        return FenceState([p.data_ptr() for p in pads], world=len(pads), num_barriers=num_barriers, first_rank=0,
                          num_local_ranks=len(pads), device=pads[0].device, pads=pads)

    def error_info(self) -> dict | None:
        """The reported timeout (after the fence's stream was synchronized), or None."""
        raw = bytes(self.error.tolist())
        flag, waiting, missing, barrier = (int.from_bytes(raw[i:i + 4], "little", signed=i > 0) for i in (0, 4, 8, 12))
        if flag != self.FLAG:
            return None
        epoch = int.from_bytes(raw[16:24], "little")
        seen = int.from_bytes(raw[24:32], "little")
        return dict(waiting_rank=waiting, missing_rank=missing, barrier_idx=barrier, epoch=epoch, seen=seen)

    def check(self):
        """Raises RuntimeError naming the missing rank when a fence of this state timed out. Call after the
        stream that ran the fence was synchronized (the kernel reports a timeout; it cannot raise)."""
        info = self.error_info()
        if info is not None:
            raise RuntimeError(
                f"pcpkv fence timeout: rank {info['waiting_rank']} waited at barrier {info['barrier_idx']} for epoch "
                f"{info['epoch']}; rank {info['missing_rank']} never arrived (its slot holds {info['seen']})")
