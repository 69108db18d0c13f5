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

from .model import CacheFormat

__all__ = ["CacheTargets", "RowDests", "FenceState", "allocate_fence_pads", "peer_pointers", "pointer_table"]


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


class CacheTargets:
    """Cache replicas a dispatch writes final rows into ("direct"): a table of pcpkv::CacheTarget records,
    host copy `host` (CPU uint8 [D, 72]) and device copy `table`. All replicas share one geometry.
    `tensors` are the local tensors behind the pointers (declared as mutated to torch.compile)."""

    def __init__(self, host: torch.Tensor, table: torch.Tensor, tensors: Sequence[torch.Tensor] = ()):
        self.host = host
        self.table = table
        self.tensors = list(tensors)

    def __len__(self):
        return self.host.shape[0]

    @staticmethod
    def from_pointers(mla_ptrs: Sequence[int], index_ptrs: Sequence[int] | None, *, like_mla: torch.Tensor,
                      like_index: torch.Tensor | None, fmt: CacheFormat, device=None,
                      tensors: Sequence[torch.Tensor] = ()) -> "CacheTargets":
        """Targets at raw addresses (peers' replicas), with the geometry of the local replicas like_mla
        (uint8 [num_blocks, block_size, row_bytes]) and like_index (uint8 [num_blocks, block_size, 132]).
        Raises ValueError when the geometry cannot hold fmt's rows or a pointer is null."""
        if fmt.has_indexer and (like_index is None or index_ptrs is None):
            raise ValueError("CacheTargets: a layer with an indexer needs index_ptrs and like_index")
        idx_ptrs = list(index_ptrs) if fmt.has_indexer else []
        idx_stride = (like_index.stride(0) if like_index.shape[0] > 1 else like_index.shape[1] * 132) if fmt.has_indexer else 0
        if fmt.has_indexer and like_index.shape[:2] != like_mla.shape[:2]:
            raise ValueError(f"CacheTargets: indexer cache blocks {list(like_index.shape[:2])} differ from the MLA "
                             f"cache's {list(like_mla.shape[:2])}")
        block_stride = like_mla.stride(0) if like_mla.shape[0] > 1 else like_mla.shape[1] * like_mla.stride(1)
        host = torch.ops.pcpkv.make_cache_targets(
            pointer_table(mla_ptrs), pointer_table(idx_ptrs), like_mla.shape[0], like_mla.shape[1],
            like_mla.stride(1), block_stride, idx_stride, fmt.kv_format, fmt.has_indexer)
        device = like_mla.device if device is None else device
        return CacheTargets(host, host.to(device), tensors)

    @staticmethod
    def from_caches(mla_caches: Sequence[torch.Tensor], index_caches: Sequence[torch.Tensor] | None,
                    fmt: CacheFormat) -> "CacheTargets":
        """Targets over local cache tensors (e.g. the W replicas of W logical ranks on one GPU); every cache
        must have the geometry of the first. Raises ValueError otherwise."""
        first = mla_caches[0]
        for c in mla_caches[1:]:
            if c.shape != first.shape or c.stride() != first.stride():
                raise ValueError("CacheTargets.from_caches: replicas differ in shape or strides")
        idx = list(index_caches) if (fmt.has_indexer and index_caches is not None) else None
        return CacheTargets.from_pointers(
            [c.data_ptr() for c in mla_caches], [c.data_ptr() for c in idx] if idx else None, like_mla=first,
            like_index=idx[0] if idx else None, fmt=fmt, tensors=list(mla_caches) + (idx or []))


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
        """Destinations at raw addresses (e.g. peer_pointers() of a symmetric staging buffer); give
        row_bytes / max_rows of the slots so that dispatch can check a call against them."""
        host = pointer_table(ptrs)
        return RowDests(host, host.to(device), tensors, row_bytes=row_bytes, max_rows=max_rows)

    @staticmethod
    def from_staging(staging: Sequence[torch.Tensor], src_rank: int, *, buffer: int = 0, ubatch: int = 0) -> "RowDests":
        """Rank src_rank's slot in every peer's staging workspace (uint8 [2, U, W, M, row_bytes], see
        allocate_staging): dests[d] = &staging[d][buffer, ubatch, src_rank, 0, 0]. Raises ValueError when the
        workspaces differ in shape or device, or src_rank / buffer / ubatch is out of range."""
        ptrs = []
        first = staging[0]
        for s in staging:
            if s.dim() != 5 or s.dtype != torch.uint8 or not s.is_contiguous():
                raise ValueError(f"staging: expected contiguous uint8 [2, U, W, M, row_bytes], got {s.dtype} "
                                 f"{list(s.shape)}")
            if s.shape != first.shape or s.device != first.device:
                raise ValueError(f"staging: workspaces differ ({list(s.shape)} on {s.device} vs "
                                 f"{list(first.shape)} on {first.device})")
        if not (0 <= buffer < first.shape[0] and 0 <= ubatch < first.shape[1] and 0 <= src_rank < first.shape[2]):
            raise ValueError(f"staging: buffer {buffer}, ubatch {ubatch}, src_rank {src_rank} out of range for "
                             f"{list(first.shape)}")
        for s in staging:
            ptrs.append(s[buffer, ubatch, src_rank].data_ptr())
        return RowDests.from_pointers(ptrs, first.device, staging, row_bytes=first.shape[4], max_rows=first.shape[3])


def allocate_fence_pads(world: int, num_barriers: int = 1, device=None) -> list[torch.Tensor]:
    """One zeroed signal pad per rank, int64 [num_barriers, 2, world] (the SPEC section 5 pad of uint64),
    for W logical ranks of one process. Ranks in separate processes put their pad in symmetric memory."""
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
        if len(pad_ptrs) != world:
            raise ValueError(f"FenceState: {len(pad_ptrs)} pad pointers for world = {world}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.world, self.num_barriers, self.first_rank = world, num_barriers, first_rank
        self.pad_table = pointer_table(pad_ptrs, device if device.type == "cuda" else None)
        self.epochs = torch.zeros((num_local_ranks, num_barriers), dtype=torch.int64, device=device)
        self.claim = torch.zeros(1, dtype=torch.int32, device=device)
        self.error = torch.zeros(32, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.pads = list(pads)
        for p in self.pads:
            # the fence writes through the pad pointers on this device: CPU code must never get device pads
            if p.device.type != device.type:
                raise ValueError(f"FenceState: a pad on {p.device} for a fence on {device}")

    @staticmethod
    def local(pads: Sequence[torch.Tensor], num_barriers: int = 1) -> "FenceState":
        """All W ranks hosted by this process (one fence call serves them all), over allocate_fence_pads()."""
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
