"""Peer tables over the caches an engine already allocated: EngineCaches.

An engine (vLLM, SGLang, ...) allocates each rank's paged caches itself with torch. EngineCaches, collective over
a torch.distributed group of the PCP ranks (one process per rank, one host), maps every peer's caches into this
process and builds the tables that `direct` and `staging` write through (CacheTargets per layer, RowDests per
staging buffer, FenceState over fence pads it allocates):

    ec = EngineCaches(mla_caches, index_caches, fmts, staging=staging, group=pcp_group)
    dispatch(..., slot_mapping=sm, targets=ec.targets[layer])              # direct: every rank's replica
    fence(ec.fence_state, written=ec.mla[layer] + (ec.index[layer] or []))
    ec.close()

How each allocation is exported and opened: PyTorch's own machinery (what torch.multiprocessing uses).
  CUDA  storage._share_cuda_(): the IPC handle of the allocation behind the storage (cudaIpcGetMemHandle of the
        caching allocator's cudaMalloc segment; with expandable_segments:True the segment's VMM handles) and the
        storage's offset in it; a peer opens it with UntypedStorage._new_shared_cuda on its own device (peer
        access enabled lazily by the driver). backend:cudaMallocAsync and pluggable allocators cannot export.
  CPU   storage already in shared memory (tensor.share_memory_()): the file_descriptor strategy's descriptor,
        opened by peers through /proc/<pid>/fd/<fd> (same user), or the file_system strategy's shm name.
A tensor's address = its storage's address as mapped here + tensor.storage_offset() * itemsize.

Every rank checks, and every rank refuses (naming the rank, the tensor by the caller's argument name, and why)
before any table exists: one host (hostname and boot id), one device type, peer access between distinct GPUs,
geometry and layout (dtype, shape, strides, CacheFormat) equal on every rank (a digest first, the details when
they differ), each cache a layout the kernels can write (tables' rules), storage that can be exported (shared
CPU memory; an allocator mode that exports), and no two of a rank's tensors sharing memory.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from typing import Optional, Sequence

import torch

from .model_spec import CacheFormat, check_cache_format
from .rank_agreement import torch_gather
from .tables import (CacheTargets, FenceState, RowDests, _describe, _index_geometry, _mla_geometry, check_num_barriers,
                     first_overlap)

__all__ = ["EngineCaches"]

_WHERE = "pcpkv_torch.EngineCaches"


def _host_identity() -> tuple[str, str]:
    """(hostname, boot id): two machines may share a hostname (containers); a boot id tells them apart."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return socket.gethostname(), boot


def _shown(x) -> str:
    return _describe(x) if isinstance(x, torch.Tensor) else repr(x)


def _cuda_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return str(getattr(props, "uuid", f"cuda:{index}"))


def _view(storage, dtype, shape, stride, offset_bytes: int, device) -> torch.Tensor:
    """A tensor over `storage` (an UntypedStorage) at offset_bytes with the given geometry."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    t = torch.empty(0, dtype=dtype, device=device)
    t.set_(storage, offset_bytes // itemsize, list(shape), list(stride))
    return t


class _Refused(Exception):
    """Setup failed on some rank: the message names every failing rank; `argument` when every failure is a
    caller's argument (ValueError), else a failure of the environment (RuntimeError)."""

    def __init__(self, msg: str, argument: bool):
        super().__init__(msg)
        self.argument = argument


class EngineCaches:
    """Peer tables over this rank's engine-allocated caches (collective over `group`; every rank passes its own):
      mla_caches      [L] uint8 [num_blocks, block_size, fmts[l].mla_row_bytes] per layer (vLLM's MLA cache)
      index_caches    [L] uint8 [index_num_blocks, block_size, 132] where fmts[l].has_indexer (its own block count
                      allowed, docs/spec.md 4.2; entries of other layers
                      are ignored; None when no layer has an indexer)
      fmts            one CacheFormat, or one per layer
      staging         optional: one staging workspace uint8 [2, U, W, M, row_bytes] (allocate_staging), or a
                      list of them (one per distinct fmt.row_bytes: a layer without an indexer has shorter rows)
    Strides may be padded (vLLM's block stride); views into one larger allocation are fine (each is exported
    through its storage). Tensors on the CPU must already be in shared memory (tensor.share_memory_()); CUDA
    tensors come from PyTorch's caching allocator (the default backend, expandable segments included). Every
    rank must pass the same layout (dtype, shape, strides, formats); storage offsets may differ.

    After setup (all or nothing):
      rank, world, device, fmts
      mla[l][r], index[l][r]  rank r's caches of layer l as mapped here (index[l] None without an indexer)
      targets[l]              CacheTargets over the W replicas of layer l ("direct")
      staging[k][r]           rank r's workspace of staging[k] as mapped here
      row_dests(fmt, buffer=0, ubatch=0)  this rank's RowDests into every rank's workspace ("staging")
      staging_for(fmt, rows)  (workspaces, [RowDests of buffer 0, 1]) as SymmetricCaches.staging_for
      pads[r], fence_state    fence pads (zeroed int64 [num_barriers, 2, W], allocated here) and this rank's state
      allocation_kinds        how each of this rank's storages was exported (e.g. 'cudaMalloc (IPC handle)')
    Raises ValueError on every rank when a rank's arguments are refused, RuntimeError when the environment is
    (other host, no peer access, storage that cannot be exported or opened, a peer that does not arrive within
    timeout_s on a gloo group); each message names the rank(s), the tensor and why. close() (or the with block)
    drops every mapping this object holds; tables and views handed out keep theirs alive until dropped (never
    dangling). Any use after close() raises RuntimeError."""

    def __init__(self, mla_caches: Sequence[torch.Tensor], index_caches: Optional[Sequence[Optional[torch.Tensor]]],
                 fmts, *, staging=None, group=None, num_barriers: int = 1, timeout_s: float = 60.0):
        import torch.distributed as dist

        from .distributed import _member_rank

        rank = _member_rank(group, _WHERE)  # a non-member (or not a group) is refused here: it has no peers to tell
        fails = []  # refused on every rank, after the first exchange: a local raise would leave the peers waiting
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e6:
            fails.append((True, f"timeout_s = {timeout_s!r} must be a positive number of seconds (< 1e6)"))
            timeout_s = 60.0
        self._closed = False
        self._group, self._timeout_s = group, float(timeout_s)
        self.rank, self.world = rank, dist.get_world_size(group)
        self._own: list = []      # (name, tensor) of this rank, in the order every rank lists them
        self._opened: list = []   # peer storages opened here (their mappings live while referenced)
        self._t: dict = {}
        self.bootstrap = None     # DistPcpWorld asks it for dead ranks; the torch group reports them here
        try:
            self._setup(fails, mla_caches, index_caches, fmts, staging, num_barriers)
        except _Refused as e:
            self._release()
            raise (ValueError if e.argument else RuntimeError)(str(e)) from None
        except BaseException:
            self._release()
            raise

    # ---- collectives ------------------------------------------------------------------------------------------

    def _gather(self, obj, what: str) -> list:
        """Every rank's obj. On a gloo group every rank first checks that every peer arrived within timeout_s and
        names those that did not (arrival_check; other backends rely on the group's own timeout); a failed
        all-gather (a peer gone after arriving) is refused naming this rank."""
        try:
            return torch_gather(self._group, f"{_WHERE}: {what}", self._timeout_s)(obj)
        except RuntimeError as e:
            raise _Refused(str(e), False) from None

    def _agree(self, failures: list, what: str):
        """failures: this rank's [(is_argument, message)]. Returns when no rank failed; else raises _Refused on
        every rank listing each failing rank's messages."""
        every = self._gather(failures, what)
        lines = [f"rank {r}: {msg}" for r, fs in enumerate(every) for _, msg in fs]
        if lines:
            argument = all(arg for fs in every for arg, _ in fs)
            raise _Refused(f"{_WHERE}: {what} refused on {sum(1 for fs in every if fs)} of {self.world} ranks:\n  " +
                           "\n  ".join(lines), argument)

    # ---- setup ------------------------------------------------------------------------------------------------

    @staticmethod
    def _local(fails: list, fn, *args):
        """fn(*args) unless a step before failed; any exception becomes this rank's refusal (every rank must reach
        the next exchange). Returns fn's result or None."""
        if fails:
            return None
        try:
            return fn(*args)
        except ValueError as e:
            fails.append((True, str(e)))
        except Exception as e:  # noqa: BLE001 - reported on every rank, naming this one
            fails.append((False, f"{type(e).__name__}: {e}"))
        return None

    def _setup(self, fails, mla_caches, index_caches, fmts, staging, num_barriers):
        self._local(fails, self._arguments, mla_caches, index_caches, fmts, staging, num_barriers)
        fails += self._local(fails, self._check_local) or []
        info = dict(host=_host_identity(), pid=os.getpid())
        info.update(self._local(fails, lambda: dict(
            device=self.device.type, digest=self._digest(),
            uuid=_cuda_uuid(self.device.index) if self.device.type == "cuda" else None)) or {})
        every = self._gather((info, fails), "arguments and layout")
        self._check_agreement(every)

        # exports: nothing leaves this process but handles; a storage torch cannot export is named here
        fails = []
        handles, tensors = self._local(fails, self._export, fails) or (None, None)
        every = self._gather((handles, tensors, fails), "exporting the caches")
        lines = [f"rank {r}: {msg}" for r, (_, _, fs) in enumerate(every) for _, msg in fs]
        if lines:
            raise _Refused(f"{_WHERE}: exporting the caches refused:\n  " + "\n  ".join(lines), False)

        fails = []
        fails += self._local(fails, self._check_peer_access, [info for info, _ in self._infos]) or []
        fails += self._local(fails, self._open, every) or []
        fails += self._local(fails, self._tables, num_barriers) or []
        self._agree(fails, "mapping the peers' caches")

    def _arguments(self, mla_caches, index_caches, fmts, staging, num_barriers):
        check_num_barriers(num_barriers, "")
        if isinstance(mla_caches, torch.Tensor) or not isinstance(mla_caches, Sequence) or not mla_caches:
            raise ValueError(f"mla_caches must be a non-empty list of per-layer MLA caches, got {_shown(mla_caches)}")
        L = len(mla_caches)
        if isinstance(fmts, CacheFormat):
            fmts = [fmts] * L
        if isinstance(fmts, (str, bytes)) or not isinstance(fmts, Sequence) or len(fmts) != L:
            raise ValueError(f"fmts = {fmts!r} must be a CacheFormat or one per layer ({L})")
        for i, f in enumerate(fmts):
            check_cache_format(f, f"fmts[{i}]")
        self.fmts = list(fmts)
        if index_caches is None:
            index_caches = [None] * L
        if isinstance(index_caches, torch.Tensor) or not isinstance(index_caches, Sequence) or len(index_caches) != L:
            raise ValueError(f"index_caches must be a list with one entry per layer ({L}; None where a layer has "
                             f"no indexer), got {_shown(index_caches)}")
        for i, f in enumerate(self.fmts):
            if f.has_indexer and not isinstance(index_caches[i], torch.Tensor):
                raise ValueError(f"index_caches[{i}] = {index_caches[i]!r}: layer {i} has an indexer "
                                 "(fmts[i].has_indexer), so it needs its indexer cache")
        if isinstance(staging, torch.Tensor):
            staging, self._staging_names = [staging], ["staging"]
        elif staging is None or isinstance(staging, Sequence) and not isinstance(staging, (str, bytes)):
            staging = list(staging or [])
            self._staging_names = [f"staging[{k}]" for k in range(len(staging))]
        else:
            raise ValueError(f"staging must be a tensor, a list of tensors or None, got {type(staging).__name__}")
        self._own = [(f"mla_caches[{i}]", c) for i, c in enumerate(mla_caches)]
        self._own += [(f"index_caches[{i}]", index_caches[i]) for i, f in enumerate(self.fmts) if f.has_indexer]
        self._own += list(zip(self._staging_names, staging))
        for name, t in self._own:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} is a {type(t).__name__}, not a tensor")
        device = mla_caches[0].device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"mla_caches[0] is on {device}: expected cpu or cuda tensors")
        for name, t in self._own:
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but mla_caches[0] on {device}: one device per rank")
        self.device = device
        # the fence pads: zeroed before any peer maps them; shared memory on the CPU
        pads = torch.zeros((num_barriers, 2, self.world), dtype=torch.int64, device=device)
        if device.type == "cpu":
            pads.share_memory_()
        # named by the argument that sizes them: ranks with other num_barriers differ in this entry's shape
        self._own.append(("fence pads [num_barriers, 2, W] (allocated by EngineCaches)", pads))
        self._num_barriers = num_barriers

    def _check_local(self) -> list:
        """This rank's own refusals: layouts the kernels cannot write, tensors sharing memory, storage that cannot
        be exported. [(is_argument, message)]."""
        fails = []
        named = dict(self._own)
        try:
            for i, f in enumerate(self.fmts):
                mla = _mla_geometry(named[f"mla_caches[{i}]"], f, f"mla_caches[{i}]")
                if f.has_indexer:
                    nb, bs, _ = _index_geometry(named[f"index_caches[{i}]"], f"index_caches[{i}]")
                    # its own num_blocks is fine (an indexer slot mapping addresses it, docs/spec.md 4.2)
                    if bs != mla[1]:
                        raise ValueError(f"index_caches[{i}] has blocks [{nb}, {bs}] but mla_caches[{i}] "
                                         f"{list(mla[:2])}: the indexer cache's block_size must be the MLA cache's")
            rows = {}
            for name in self._staging_names:
                s = named[name]
                if s.dim() != 5 or s.dtype != torch.uint8 or not s.is_contiguous() or s.shape[2] != self.world:
                    raise ValueError(f"{name}: expected a contiguous uint8 [2, U, W={self.world}, M, row_bytes] "
                                     f"staging workspace, got {_describe(s)}")
                if s.shape[0] != 2 or min(s.shape) < 1:
                    raise ValueError(f"{name}: expected two buffers of non-empty slots, got {_describe(s)}")
                rb = s.shape[4]
                if rb not in {f.row_bytes for f in self.fmts}:
                    raise ValueError(f"{name}: rows of {rb} B match no layer's fmt.row_bytes "
                                     f"({sorted({f.row_bytes for f in self.fmts})})")
                if rb in rows:
                    raise ValueError(f"{name} and {rows[rb]} both hold {rb} B rows: give one workspace per row size")
                rows[rb] = name
        except ValueError as e:
            fails.append((True, str(e)))
        hit = first_overlap(self._own) and _first_interleaved_overlap(self._own)
        if hit:
            (a, ta), (b, tb) = hit
            fails.append((True, f"{a} ({_describe(ta)}) shares memory with {b} ({_describe(tb)}): every rank writes "
                                "each of them, so no two may overlap"))
        if self.device.type == "cpu":
            for name, t in self._own:
                if not t.is_shared():
                    fails.append((True, f"{name} ({_describe(t)}) is not in shared memory, so peers cannot map it: "
                                        "allocate it with .share_memory_() (torch's file_descriptor or file_system "
                                        "strategy) before EngineCaches; pcpkv never moves an engine's tensor"))
                elif self._cpu_kind(t) is None:
                    fails.append((True, f"{name} ({_describe(t)}) is shared memory without a descriptor or shm name "
                                        "torch can pass (e.g. torch.from_file(shared=True)): allocate it with "
                                        ".share_memory_()"))
        else:
            backend = torch.cuda.memory.get_allocator_backend()
            if backend != "native":
                conf = {k: os.environ[k] for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if k in os.environ}
                fails.append((False, f"PyTorch's CUDA allocator backend is {backend!r} ({conf}): its memory has no "
                                     "IPC handle, so peers cannot map the caches; allocate them with the native "
                                     "caching allocator (remove backend:cudaMallocAsync from PYTORCH_ALLOC_CONF / "
                                     "PYTORCH_CUDA_ALLOC_CONF) or use transport collect"))
        return fails

    @staticmethod
    def _cpu_kind(t: torch.Tensor):
        """'fd' (file_descriptor strategy), 'file' (file_system strategy) or None for shared CPU storage."""
        s = t.untyped_storage()
        try:
            return "fd" if s._get_shared_fd() >= 0 else None
        except RuntimeError:  # no MapAllocator: libshm's managed (file_system) storage
            return "file"

    def _layout(self) -> list:
        """What every rank must agree on: per tensor (name, dtype, shape, strides), formats, pads."""
        out = [(n, str(t.dtype), tuple(t.shape), tuple(t.stride())) for n, t in self._own]
        # k_scale as the float32 the kernels divide by: 2, 2.0 and numpy's float32(2) are one format
        out.append(("fmts", tuple((f.kv_format, f.ds_mla_scale, struct.unpack("f", struct.pack("f", f.k_scale))[0],
                                   f.has_indexer) for f in self.fmts)))
        return out

    def _digest(self) -> str:
        return hashlib.sha256(repr((self.device.type, self._layout())).encode()).hexdigest()

    def _check_agreement(self, every):
        """Host, device type and layout of every rank against rank 0's (after each rank's own refusals)."""
        self._infos = every
        lines = [f"rank {r}: {msg}" for r, (_, fs) in enumerate(every) for _, msg in fs]
        argument = all(arg for _, fs in every for arg, _ in fs)
        if lines:  # a layout compared with a refused one would only repeat the refusal
            raise _Refused(f"{_WHERE}: arguments refused on {sum(1 for _, fs in every if fs)} of {self.world} "
                           "ranks:\n  " + "\n  ".join(lines), argument)
        h0 = every[0][0]["host"]
        for r, (info, _) in enumerate(every):
            if info["host"] != h0:
                lines.append(f"rank {r} is on host {info['host'][0]!r} (boot id {info['host'][1]}) but rank 0 on "
                             f"{h0[0]!r} (boot id {h0[1]}): peer tables need every rank on one host (use collect)")
            elif info["device"] != every[0][0]["device"]:
                lines.append(f"rank {r}'s caches are on {info['device']} but rank 0's on {every[0][0]['device']}")
        if lines:
            raise _Refused(f"{_WHERE}: " + "\n  ".join(lines), False)
        if len({info["digest"] for info, _ in every}) > 1:
            # the digests differ: now the details, to name the rank, the tensor and the field
            layouts = self._gather(self._layout(), "layout details")
            lines = [self._differs(r, layouts[r], layouts[0]) for r in range(1, self.world)
                     if layouts[r] != layouts[0]]
            raise _Refused(f"{_WHERE}: every rank must pass caches of one layout (the tables record one "
                           "geometry):\n  " + "\n  ".join(lines), True)

    @staticmethod
    def _differs(r: int, mine: list, ref: list) -> str:
        if len(mine) != len(ref):
            return (f"rank {r} passes {len(mine)} tensors ({', '.join(e[0] for e in mine)}) but rank 0 {len(ref)} "
                    f"({', '.join(e[0] for e in ref)})")
        for a, b in zip(mine, ref):
            if a[0] != b[0]:
                return f"rank {r} passes {a[0]} where rank 0 passes {b[0]}"
            if a != b:
                if a[0] == "fmts":
                    return f"rank {r}: fmts {a[1]} differ from rank 0's {b[1]}"
                field = next(f for f, x, y in zip(("dtype", "shape", "strides"), a[1:], b[1:]) if x != y)
                i = ("dtype", "shape", "strides").index(field) + 1
                return f"rank {r}: {a[0]} has {field} {list(a[i]) if i > 1 else a[i]} but rank 0's has " \
                       f"{list(b[i]) if i > 1 else b[i]}"
        return f"rank {r}: layout differs from rank 0's"

    def _export(self, fails: list):
        """(handles, tensors): one handle per distinct storage of this rank, and per tensor (storage index, byte
        offset in that storage, dtype, shape, strides); a storage that cannot be exported is added to fails."""
        handles, kinds, tensors, index = [], [], [], {}
        for name, t in self._own:
            s = t.untyped_storage()
            key = (s.data_ptr(), s.nbytes())  # one storage, however many tensors view it
            if key not in index:  # views of one allocation are exported (and opened by peers) once
                handle = kind = None
                try:
                    handle, kind = self._export_storage(s, t)
                except Exception as e:  # noqa: BLE001 - torch's reason, named and agreed on by every rank
                    fails.append((False, f"{name} ({_describe(t)}): its storage cannot be exported ({e}); "
                                         f"{self._export_advice(e)}"))
                index[key] = len(handles)
                handles.append(handle)
                kinds.append(kind)
            tensors.append((index[key], t.data_ptr() - key[0], t.dtype, tuple(t.shape), tuple(t.stride())))
        self.allocation_kinds = {name: kinds[x[0]] for (name, _), x in zip(self._own, tensors)}
        return handles, tensors

    def _export_storage(self, s, t):
        if t.device.type == "cuda":
            h = s._share_cuda_()
            kind = "expandable segment (VMM handles)" if h[1][1:2] == b"e" else "cudaMalloc (IPC handle)"
            return ("cuda",) + tuple(h), kind
        if self._cpu_kind(t) == "fd":
            fd, size = s._share_fd_cpu_()
            st = os.fstat(fd)
            return ("fd", os.getpid(), fd, size, st.st_dev, st.st_ino), "shared memory (file descriptor)"
        manager, name, size = s._share_filename_cpu_()
        return ("file", manager, name, size), "shared memory (file_system strategy)"

    @staticmethod
    def _export_advice(e: Exception) -> str:
        msg = str(e)
        conf = " ".join(os.environ.get(k, "") for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")).lower()
        if "expandable" in msg or "cuMemExportToShareableHandle" in msg or "expandable_segments:true" in conf:
            return ("with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the segments must be created exportable "
                    "(TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=1, set before the first CUDA allocation), or allocate the "
                    "caches with expandable_segments:False")
        if "received from another process" in msg:
            return "the caches must be this process's own allocations (clone a tensor received from another process)"
        return ("allocate the caches with PyTorch's native caching allocator (PYTORCH_CUDA_ALLOC_CONF without "
                "backend:cudaMallocAsync or a pluggable allocator) or use transport collect")

    def _check_peer_access(self, infos) -> list:
        """Every peer on another GPU must be visible here and reachable by peer access (same GPU: always)."""
        if self.device.type != "cuda":
            return []
        fails, mine = [], self.device.index
        by_uuid = {_cuda_uuid(i): i for i in range(torch.cuda.device_count())}
        for r, info in enumerate(infos):
            if r == self.rank or info["uuid"] == infos[self.rank]["uuid"]:
                continue
            other = by_uuid.get(info["uuid"])
            if other is None:
                fails.append((False, f"rank {r}'s GPU {info['uuid']} is not visible to this process "
                                     "(CUDA_VISIBLE_DEVICES): its caches cannot be mapped here"))
            elif not torch.cuda.can_device_access_peer(mine, other):
                fails.append((False, f"cuda:{mine} cannot access rank {r}'s GPU cuda:{other} by peer access "
                                     "(torch.cuda.can_device_access_peer is False): direct and staging store into "
                                     "peers' memory; use transport collect"))
        return fails

    def _open(self, every) -> list:
        """Opens each peer storage once and builds views of every peer tensor: self._peer[r] = [tensor...]."""
        fails = []
        self._peer = []
        for r, (handles, tensors, _) in enumerate(every):
            if r == self.rank:
                self._peer.append([t for _, t in self._own])
                continue
            storages = []
            for k, h in enumerate(handles):
                try:
                    storages.append(self._open_storage(h))
                except Exception as e:  # noqa: BLE001 - named and agreed on by every rank
                    name = next(self._own[i][0] for i, x in enumerate(tensors) if x[0] == k)
                    fails.append((False, f"cannot map rank {r}'s {name}: {e}{self._open_advice(h)}"))
                    storages.append(None)
            self._opened += [s for s in storages if s is not None]
            if fails:
                continue
            self._peer.append([_view(storages[k], dt, shape, stride, off, self.device)
                               for k, off, dt, shape, stride in tensors])
        return fails

    @staticmethod
    def _open_advice(h) -> str:
        if h[0] == "cuda" and h[2][1:2] == b"e":
            return ("; its storage is an expandable segment (PYTORCH_ALLOC_CONF=expandable_segments:True), imported "
                    "through pidfd_getfd, which needs the owner's PID namespace and ptrace permission (same user and "
                    "/proc/sys/kernel/yama/ptrace_scope 0, or CAP_SYS_PTRACE): allow it, or allocate the caches with "
                    "expandable_segments:False")
        if h[0] == "fd":
            return ("; its shared memory is opened through /proc/<pid>/fd, which needs the same user and PID "
                    "namespace")
        return ""

    def _open_storage(self, h):
        if h[0] == "cuda":
            # opened in this rank's own device context: the driver enables peer access to the owner's GPU
            return torch.UntypedStorage._new_shared_cuda(self.device.index, *h[2:])
        if h[0] == "fd":
            _, pid, fd, size, dev, ino = h
            local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
            try:
                st = os.fstat(local)
                if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size < size:
                    raise RuntimeError(f"descriptor {fd} of pid {pid} is no longer the shared segment it exported")
                return torch.UntypedStorage._new_shared_fd_cpu(local, size)
            finally:
                os.close(local)
        _, manager, name, size = h
        return torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)

    def _tables(self, num_barriers) -> list:
        W, peers = self.world, self._peer
        pos = {name: i for i, (name, _) in enumerate(self._own)}
        t = dict(mla=[], index=[], targets=[], staging=[], dests={})
        try:
            for i, f in enumerate(self.fmts):
                mla = [peers[r][pos[f"mla_caches[{i}]"]] for r in range(W)]
                idx = [peers[r][pos[f"index_caches[{i}]"]] for r in range(W)] if f.has_indexer else None
                t["mla"].append(mla)
                t["index"].append(idx)
                t["targets"].append(CacheTargets.from_caches(mla, idx, f))
            for name in self._staging_names:
                ws = [peers[r][pos[name]] for r in range(W)]
                t["staging"].append(ws)
                t["dests"][ws[0].shape[4]] = (ws, [[RowDests.from_staging(ws, self.rank, buffer=b, ubatch=u)
                                                    for u in range(ws[0].shape[1])] for b in range(2)])
            pads = [peers[r][-1] for r in range(W)]
            t["pads"] = pads
            t["fence_state"] = FenceState([p.data_ptr() for p in pads], world=W, num_barriers=num_barriers,
                                          first_rank=self.rank, num_local_ranks=1, device=self.device,
                                          pads=[pads[self.rank]])
        except ValueError as e:
            return [(False, f"building the tables over the mapped caches: {e}")]
        self._t = t
        return []

    # ---- the tables -------------------------------------------------------------------------------------------

    def _get(self, key, what: Optional[str] = None):
        if self._closed:
            raise RuntimeError(f"{_WHERE}: {what or key} used after close() (the peer mappings are released)")
        return self._t[key]

    mla = property(lambda self: self._get("mla"))
    index = property(lambda self: self._get("index"))
    targets = property(lambda self: self._get("targets"))
    staging = property(lambda self: self._get("staging"))
    pads = property(lambda self: self._get("pads"))
    fence_state = property(lambda self: self._get("fence_state"))

    def _dests(self, fmt: CacheFormat, where: str):
        """(workspaces [W], RowDests [buffer][ubatch]) of the staging tensor holding fmt's rows; errors name `where`
        (the method the caller called)."""
        dests = self._get("dests", where)
        check_cache_format(fmt, f"{_WHERE}.{where}")
        if fmt.row_bytes not in dests:
            raise ValueError(f"{_WHERE}.{where}: no staging workspace holds {fmt.row_bytes} B rows "
                             f"(fmt {fmt.kv_format}, has_indexer={fmt.has_indexer}); given: {sorted(dests)} B")
        return dests[fmt.row_bytes]

    def row_dests(self, fmt: CacheFormat, buffer: int = 0, ubatch: int = 0) -> RowDests:
        """This rank's RowDests into every rank's workspace of the staging tensor with fmt.row_bytes rows.
        Raises ValueError when no staging workspace holds fmt's rows or buffer / ubatch is out of range."""
        per_buffer = self._dests(fmt, "row_dests")[1]
        for name, v, n in (("buffer", buffer, 2), ("ubatch", ubatch, len(per_buffer[0]))):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
                raise ValueError(f"{_WHERE}.row_dests: {name} = {v!r} must be an integer in [0, {n})")
        return per_buffer[buffer][ubatch]

    def staging_for(self, fmt: CacheFormat, rows: int):
        """(workspaces [W], [RowDests of buffer 0, buffer 1] at ubatch 0) for fmt's rows, as
        SymmetricCaches.staging_for (nothing is allocated: ValueError when the engine's workspace holds fewer
        than `rows` rows per rank or none holds fmt's rows)."""
        ws, per_buffer = self._dests(fmt, "staging_for")
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= ws[0].shape[3]:
            raise ValueError(f"{_WHERE}.staging_for: rows = {rows!r} must be an integer in [1, {ws[0].shape[3]}] "
                             "(the staging workspace's rows per rank)")
        return ws, [per_buffer[0][0], per_buffer[1][0]]

    # ---- teardown ---------------------------------------------------------------------------------------------

    def _release(self):
        self._t, self._peer, self._opened, self._own = {}, [], [], []

    def close(self):
        """Drops every peer mapping, view and table this object holds, and its fence pads (local: needs no peer).
        A mapping is unmapped once no table or view handed out still references it."""
        self._release()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _block_runs(t: torch.Tensor) -> tuple:
    """(start, step, count, length) in bytes: t's memory as `count` runs of `length` bytes, `step` apart (its
    blocks along dim 0), or one run of its whole extent."""
    size = t.element_size()
    extent = lambda dims: (sum((n - 1) * st for n, st in dims) + 1) * size  # noqa: E731
    if t.dim() >= 2 and t.shape[0] > 1 and t.stride(0) > 0:
        return t.data_ptr(), t.stride(0) * size, t.shape[0], extent(zip(t.shape[1:], t.stride()[1:]))
    return t.data_ptr(), 0, 1, extent(zip(t.shape, t.stride()))


def _runs_overlap(a: tuple, b: tuple) -> bool:
    """Whether two block-run sets share a byte: exact when they step alike (or one is a single run), else by
    extent. vLLM's cross-layer layout (one [num_blocks, L, block_size, row] buffer, layer l = buf[:, l]) gives L
    caches whose extents overlap while their bytes never do."""
    (sa, pa, na, la), (sb, pb, nb, lb) = a, b
    if sa + (na - 1) * pa + la <= sb or sb + (nb - 1) * pb + lb <= sa:
        return False
    step = pa if nb == 1 else pb
    if (na > 1 and nb > 1 and pa != pb) or step == 0:
        return True
    # run i of a and run j of b meet iff -lb < (sb - sa) + k * step < la for k = j - i in [-(na - 1), nb - 1]
    d = sb - sa
    k_lo, k_hi = (-lb - d) // step + 1, -((d - la) // step) - 1
    return max(k_lo, -(na - 1)) <= min(k_hi, nb - 1)


def _first_interleaved_overlap(named: list):
    """The first pair of (name, tensor) whose bytes overlap by _runs_overlap, or None (called only when
    first_overlap, by byte extents, found one)."""
    runs = [_block_runs(t) for _, t in named]
    for i in range(len(named)):
        for j in range(i + 1, len(named)):
            if _runs_overlap(runs[i], runs[j]):
                return named[i], named[j]
    return None
