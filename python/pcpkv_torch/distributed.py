"""One process per PCP rank under torch.distributed: pcpkv's bootstrap and symmetric memory for a process group.

    import torch.distributed as dist
    from pcpkv_torch.distributed import SymmetricCaches
    dist.init_process_group("gloo")                        # torchrun's env; "nccl" on GPUs works the same
    with SymmetricCaches(num_layers=4, num_blocks=64, block_size=64, kv_format="fp8_ds_mla",
                         has_indexer=[True] * 4, device="cpu") as c:
        dispatch(..., slot_mapping=sm, targets=c.targets[layer])   # direct: stores into every rank's replica
        fence(c.fence_state)                                       # cross-process fence over symmetric pads

The torch group only carries rank 0's bootstrap address and a fresh job token (broadcast_object_list); every
rank then meets the others through pcpkv's own bootstrap (pcpkv/ranks/bootstrap.h: a Unix-domain socket in a 0700
directory, same-user check by SO_PEERCRED both ways, the job token) and shares memory through it:
  CPU   POSIX shared memory (shm_open 0600, unlinked at once), the descriptors passed over the socket, mmap'd
  CUDA  cuMemCreate buffers exported as POSIX file descriptors, imported and cuMemMap'd by every rank
        (several ranks may share one GPU; peers on other GPUs need peer access)
Every rank's buffers are mapped in every process, so the peer tables (CacheTargets, RowDests, FenceState) hold
real addresses. The group must live on one host. Setup is all or nothing, and every rank raises the same error:
ValueError for a bad argument on any rank (naming the rank, the argument and its value) or ranks that disagree on
the layout (naming the first field, the layer and both ranks' values), checked before any shared memory is
written; RuntimeError for a failed allocation or mapping, or a peer that exits or is killed (naming the rank and
why). close() (or leaving the with block) releases every mapping and descriptor once no tensor handed out is
alive (views keep their mapping, never dangle); any later use raises RuntimeError "... used after close()".

PyTorch's own symmetric memory (torch.distributed._symmetric_memory.rendezvous) keeps working: its handles go
to tables.peer_pointers() as before.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Optional, Sequence

import torch

from .layout import check_block_size
from .model_spec import MLA_ROW_BYTES, CacheFormat, check_cache_format
from .rank_agreement import agree_on, share_verdicts, torch_gather
from .tables import CacheTargets, FenceState, RowDests, check_num_barriers

__all__ = ["Bootstrap", "SymmetricBuffer", "SymmetricCaches", "resource_counts", "dead_ranks"]

_ALIGN = 256  # every view starts 256-byte aligned (the kernels' vector stores; fp32 scales)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def resource_counts() -> dict:
    """This process's open descriptors, /dev/shm mappings and /dev/nvidia* mappings (leak checks)."""
    fds, shm, dev = torch.ops.pcpkv.resource_counts()
    return {"open_fds": fds, "shm_mappings": shm, "device_mappings": dev}


def _socket_path() -> str:
    base = os.environ.get("PCPKV_BOOTSTRAP_DIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(base, f"pcpkv-{os.geteuid()}", f"torch-{os.getpid()}-{secrets.token_hex(4)}.sock")


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has exited
    except (OSError, IndexError):
        return False


def dead_ranks(pids: Sequence[int]) -> list[int]:
    """Ranks whose process (pids[r], from Bootstrap.pids) has exited or was killed."""
    return [r for r, p in enumerate(pids) if not _pid_alive(int(p))]


def _require_dist(what: str):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first, e.g. under torchrun)")
    return dist


def _member_rank(group, what: str) -> int:
    """This process's rank in group, or ValueError (raised here only: a non-member has no peers to tell)."""
    dist = _require_dist(what)
    try:
        rank = dist.get_rank(group)
    except Exception as e:  # noqa: BLE001 - anything that is not a process group
        raise ValueError(f"{what}: group = {group!r} is not a torch.distributed process group ({e})") from None
    if rank < 0:
        raise ValueError(f"{what}: group: this process (rank {dist.get_rank()} of the default group) is not a "
                         "member of the group it passed (torch.distributed.new_group left it out); only the "
                         "group's members may call")
    return rank


def _timeout_problem(timeout_s) -> str:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        return f"timeout_s = {timeout_s!r} must be a positive number of seconds"
    return ""


class Bootstrap:
    """pcpkv's rendezvous for the ranks of a torch.distributed group (collective over the group). group: None
    for the default group. timeout_s bounds every blocking step (rendezvous, each collective); a peer that exits
    or is killed is named in the error. Raises ValueError on every rank when timeout_s is bad on any (naming
    the rank and the value; the rank still takes part in the torch group's exchange, so no peer waits for it),
    ValueError on this rank alone when it is not a member of group; RuntimeError when torch.distributed is not
    initialized, the group spans hosts, or the rendezvous fails (naming the rank and why). Methods after
    close(): RuntimeError "Bootstrap.<method> used after close()"."""

    def __init__(self, group=None, *, timeout_s: float = 60.0):
        import torch.distributed as dist

        self.rank = _member_rank(group, "Bootstrap")
        self.group = group
        self.world = dist.get_world_size(group)
        # the first exchange carries each rank's verdict on its own arguments along with its host
        why = _timeout_problem(timeout_s)
        mine = f"{socket.gethostname()}\n{why}"
        wait = 60.0 if why else float(timeout_s)  # a bad timeout_s is refused after this exchange, on every rank
        got = [s.split("\n", 1) for s in torch_gather(group, "Bootstrap", wait)(mine)]
        share_verdicts(lambda _: [w for _, w in got], "Bootstrap", "")
        hosts = [h for h, _ in got]
        if len(set(hosts)) != 1:
            other = next(r for r, h in enumerate(hosts) if h != hosts[0])
            raise RuntimeError(f"pcpkv_torch.distributed: the group spans hosts (rank 0 on {hosts[0]!r}, rank {other} "
                               f"on {hosts[other]!r}); symmetric memory needs every rank on one host")
        msg = [_socket_path(), torch.ops.pcpkv.make_job_token()] if self.rank == 0 else [None, None]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(msg, src=src, group=group)
        address, token = msg
        job = f"torch.distributed group of {self.world} ranks (MASTER_PORT {os.environ.get('MASTER_PORT', '?')})"
        self._h = torch.classes.pcpkv.Bootstrap(self.rank, self.world, address, token, job, float(timeout_s))
        self.timeout_s = float(timeout_s)
        self.pids = list(self._h.pids())

    def _open(self, what: str):
        if self._h.closed():
            raise RuntimeError(f"Bootstrap.{what} used after close()")
        return self._h

    def barrier(self):
        self._open("barrier").barrier()

    def agree(self, ok: bool, why: str, what: str):
        """All-or-nothing: returns when every rank passed ok=True, else raises RuntimeError on every rank naming
        each failed rank and its `why`."""
        self._open("agree").agree(bool(ok), str(why), str(what))

    def all_gather(self, s: str) -> list[str]:
        """Every rank's string, in rank order (setup-time descriptions: small)."""
        return list(self._open("all_gather").all_gather(str(s)))

    def abort(self, why: str):
        """Tells the peers this rank gives up (their next collective raises naming it); never raises."""
        self._h.abort(str(why))

    def dead_ranks(self) -> list[int]:
        return dead_ranks(self.pids)

    def close(self):
        self._h.close()

    @property
    def closed(self) -> bool:
        return self._h.closed()


def _device_of(device) -> torch.device:
    try:
        device = torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError, ValueError) as e:  # torch.device("bogus") raises RuntimeError
        raise ValueError(f"device = {device!r} is not a device; expected cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device = {device}; expected cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device = {device}: no CUDA device is visible to torch")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return device


class SymmetricBuffer:
    """nbytes (> 0, equal on every rank) of symmetric memory per rank (collective over boot): local is this
    rank's buffer, peers[r] rank r's buffer as mapped here (uint8 [nbytes] on `device`), ptrs[r] its address.
    The local buffer is filled with `fill` before any peer maps it. name names it in messages."""

    def __init__(self, boot: Bootstrap, nbytes: int, name: str, device=None, *, fill: int = 0):
        device = _device_of(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.zeros(1, device=device)  # the runtime's primary context is current for pcpkv's driver calls
        self.name, self.device = name, device
        self._h = torch.classes.pcpkv.SymmetricBuffer(boot._h, int(nbytes), name, int(fill), device.type,
                                                      device.index if device.index is not None else -1)
        self.rank, self.world = boot.rank, boot.world
        self._closed = False
        self._ptrs = list(self._h.ptrs())
        self._peers = [self._h.buffer(r) for r in range(self.world)]

    def _open(self, what: str):
        if self._closed:
            raise RuntimeError(f"SymmetricBuffer {self.name!r}: {what} used after close()")

    @property
    def ptrs(self) -> list[int]:
        self._open("ptrs")
        return self._ptrs

    @property
    def peers(self) -> list:
        self._open("peers")
        return self._peers

    @property
    def local(self) -> torch.Tensor:
        self._open("local")
        return self._peers[self.rank]

    def close(self):
        """Drops this object's views and its reference to the mappings (freed when no view is left)."""
        self._closed, self._peers, self._ptrs = True, [], []
        self._h.close()


def _open_only(name: str) -> property:
    """SymmetricCaches.<name> (stored as _<name>); RuntimeError after close()."""
    def get(self):
        self._open(name)
        return getattr(self, "_" + name)
    return property(get)


class SymmetricCaches:
    """Every rank's PCP caches of num_layers layers in symmetric memory (collective over `group`):
      mla[layer][r]    uint8 [num_blocks, block_size, row_bytes(kv_format)]   rank r's MLA replica, mapped here
      index[layer][r]  uint8 [num_blocks, block_size, 132] (None on a layer without an indexer)
      targets[layer]   CacheTargets over the W replicas (a direct dispatch writes every rank's replica)
      pads[r]          int64 [num_barriers, 2, W] fence pads; fence_state: FenceState of this rank
      staging_for(fmt, rows): every rank's staging workspace uint8 [2, 1, W, rows, fmt.row_bytes] and this
                       rank's RowDests per buffer (allocated on first use, collectively)
    rank / world: this process's rank and the group size; bootstrap: the Bootstrap (made here when not given).
    Caches are filled with `fill` (a guard byte), pads and staging with zeros, before any peer maps them; setup
    ends with a barrier, so no peer writes into a replica before it is initialized.
    has_indexer: bool or one bool per layer. device: cpu or cuda (several ranks may share one GPU).
    Every rank must pass the same layout: per layer the format (kv_format, ds_mla_scale), has_indexer,
    block_size, num_blocks and the views' offsets, shapes and strides, the fence pads (num_barriers) and the
    device kind; a sha256 digest of it is compared at setup, before any shared memory is written.
    Raises, on every rank with the same message: ValueError for a bad argument on any rank (each argument is
    checked locally first, then the verdicts are shared, so no rank waits out timeout_s; naming the rank, the
    argument and its value) and for ranks that disagree on the layout ("SymmetricCaches: ranks disagree on
    layer 0 has_indexer: rank 0 True, rank 1 False"); RuntimeError for a failed allocation or mapping, or a peer
    that exits or is killed during setup (naming it and why). A process outside `group` gets ValueError at once
    (it has no peers to tell). Nothing stays allocated after a failure. After close(), mla / index / targets /
    pads / fence_state / staging_for raise RuntimeError "SymmetricCaches.<name> used after close()"."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_format: str = "fp8_ds_mla",
                 ds_mla_scale: str = "pow2", has_indexer=True, device=None, group=None,
                 bootstrap: Optional[Bootstrap] = None, timeout_s: float = 60.0, fill: int = 0xA5,
                 num_barriers: int = 1):
        what = "SymmetricCaches"
        self._buffers: list = []
        self._closed = False
        self._mla, self._index, self._targets, self._pads, self._fence_state = [], [], [], [], None
        self._staging: dict = {}
        self.bootstrap = None
        # Not a Bootstrap: a bad argument like any other, its verdict shared over the group as when none is given
        # (raised here alone, the peers waited for it in their exchange, then paired it with this rank's next one).
        bad_boot = ""
        if bootstrap is not None and not isinstance(bootstrap, Bootstrap):
            bad_boot = f"bootstrap = {bootstrap!r} must be a pcpkv_torch.distributed.Bootstrap or None"
            bootstrap = None
        self._own_boot = bootstrap is None
        if bootstrap is not None and bootstrap.closed:
            raise RuntimeError(f"{what}: the bootstrap passed was used after close()")
        if bootstrap is None:
            _member_rank(group, what)
        try:  # every argument checked here, then the verdicts shared: no rank raises alone and leaves peers waiting
            if bad_boot:
                raise ValueError(bad_boot)
            self.fmts = self._check(num_layers, num_blocks, block_size, kv_format, ds_mla_scale, has_indexer,
                                    num_barriers, fill)
            self.device = _device_of(device)
            why = _timeout_problem(timeout_s) if self._own_boot else ""
        except ValueError as e:
            why = str(e)
        if bootstrap is None:
            wait = 60.0 if _timeout_problem(timeout_s) else float(timeout_s)  # a bad one: refused by this exchange
            share_verdicts(torch_gather(group, what, wait), what, why)
            bootstrap = Bootstrap(group, timeout_s=timeout_s)
            self.bootstrap = bootstrap
        else:
            self.bootstrap = bootstrap
            share_verdicts(bootstrap.all_gather, what, why)
        self.rank, self.world = bootstrap.rank, bootstrap.world
        try:
            layout, total = self._layout(num_blocks, block_size)
            agree_on(bootstrap.all_gather, what, self._description(layout, total, num_blocks, block_size,
                                                                   num_barriers))
            self._setup(layout, total, num_blocks, block_size, int(fill), num_barriers)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check(num_layers, num_blocks, block_size, kv_format, ds_mla_scale, has_indexer, num_barriers, fill):
        for name, v, lo in (("num_layers", num_layers, 1), ("num_blocks", num_blocks, 1),
                            ("block_size", block_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} = {v!r} must be an integer >= {lo}")
        check_num_barriers(num_barriers, "")
        check_block_size(block_size)
        if not isinstance(kv_format, str) or kv_format not in MLA_ROW_BYTES:
            raise ValueError(f"kv_format = {kv_format!r}; expected one of {sorted(MLA_ROW_BYTES)}")
        if isinstance(fill, bool) or not isinstance(fill, int) or not 0 <= fill <= 255:
            raise ValueError(f"fill = {fill!r} must be a byte value")
        try:
            flags = [has_indexer] * num_layers if isinstance(has_indexer, bool) else list(has_indexer)
        except TypeError:  # None, a number: not one bool per layer
            flags = None
        if flags is None or len(flags) != num_layers or not all(isinstance(f, bool) for f in flags):
            raise ValueError(f"has_indexer = {has_indexer!r} must be a bool or {num_layers} bools")
        return [CacheFormat(kv_format, ds_mla_scale, has_indexer=f) for f in flags]

    def _layout(self, num_blocks, block_size):
        """([(mla offset, indexer offset or None)] per layer, bytes): every view starts 256-byte aligned."""
        slots, layout, off = num_blocks * block_size, [], 0
        for fmt in self.fmts:
            mla_off = off
            off = _align(off + slots * fmt.mla_row_bytes)
            idx_off = off if fmt.has_indexer else None
            off = _align(off + slots * 132) if fmt.has_indexer else off
            layout.append((mla_off, idx_off))
        return layout, off

    def _description(self, layout, total, num_blocks, block_size, num_barriers) -> list:
        """What every rank must hold the same, field by field, in the order a mismatch is reported."""
        d = [("device kind", self.device.type), ("num_layers", len(self.fmts))]
        for i, (fmt, (mo, io)) in enumerate(zip(self.fmts, layout)):
            row, at = fmt.mla_row_bytes, f"layer {i} "
            d += [(at + "kv_format", fmt.kv_format), (at + "ds_mla_scale", fmt.ds_mla_scale),
                  (at + "has_indexer", fmt.has_indexer), (at + "block_size", block_size),
                  (at + "num_blocks", num_blocks),
                  (at + "MLA cache offset, shape, strides",
                   [mo, [num_blocks, block_size, row], [block_size * row, row, 1]]),
                  (at + "indexer cache offset, shape, strides",
                   None if io is None else [io, [num_blocks, block_size, 132], [block_size * 132, 132, 1]])]
        return d + [("caches bytes", total), ("fence pads [num_barriers, 2, W]", [num_barriers, 2, self.world])]

    def _alloc(self, nbytes: int, name: str, fill: int) -> SymmetricBuffer:
        buf = SymmetricBuffer(self.bootstrap, nbytes, name, self.device, fill=fill)
        self._buffers.append(buf)
        return buf

    def _setup(self, layout, total, num_blocks, block_size, fill, num_barriers):
        W, slots = self.world, num_blocks * block_size
        caches = self._alloc(total, "caches", fill)
        for fmt, (mo, io) in zip(self.fmts, layout):
            row = fmt.mla_row_bytes
            mla = [b[mo:mo + slots * row].view(num_blocks, block_size, row) for b in caches.peers]
            idx = [b[io:io + slots * 132].view(num_blocks, block_size, 132) for b in caches.peers] \
                if fmt.has_indexer else None
            self._mla.append(mla)
            self._index.append(idx)
            self._targets.append(CacheTargets.from_caches(mla, idx, fmt))
        pad_elems = num_barriers * 2 * W
        pads = self._alloc(pad_elems * 8, "fence pads", 0)
        self._pads = [b.view(torch.int64).view(num_barriers, 2, W) for b in pads.peers]
        self._fence_state = FenceState(pads.ptrs, world=W, num_barriers=num_barriers, first_rank=self.rank,
                                       num_local_ranks=1, device=self.device, pads=[self._pads[self.rank]])
        self.bootstrap.barrier()

    def _open(self, name: str):
        if self._closed:
            raise RuntimeError(f"SymmetricCaches.{name} used after close()")

    mla = _open_only("mla")
    index = _open_only("index")
    targets = _open_only("targets")
    pads = _open_only("pads")
    fence_state = _open_only("fence_state")

    def staging_for(self, fmt: CacheFormat, rows: int):
        """(workspaces [W] uint8 [2, 1, W, M, fmt.row_bytes], dests [2] RowDests of this rank per buffer) with
        M >= rows, allocated on first use for fmt.row_bytes (collective: every rank must ask for the same
        row_bytes and rows in the same order; a run of the same plan on every rank does). An allocation first
        compares the staging shape across ranks: ValueError on every rank naming both ranks' shapes, nothing
        allocated."""
        self._open("staging_for")
        check_cache_format(fmt, "staging_for")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"staging_for: rows = {rows!r} must be an integer >= 1")
        have = self._staging.get(fmt.row_bytes)
        if have is None or have[0] < rows:
            W = self.world
            shape = [2, 1, W, rows, fmt.row_bytes]
            agree_on(self.bootstrap.all_gather, "SymmetricCaches.staging_for",
                     [("staging shape [2, 1, W, rows, row_bytes]", shape)])
            if have is not None:
                have[3].close()
                self._buffers.remove(have[3])
                del self._staging[fmt.row_bytes]
            buf = self._alloc(2 * W * rows * fmt.row_bytes, f"staging {fmt.row_bytes} B x {rows}", 0)
            ws = [b.view(*shape) for b in buf.peers]
            dests = [RowDests.from_staging(ws, self.rank, buffer=k) for k in range(2)]
            self.bootstrap.barrier()  # every peer has its new workspace before anyone stores into it
            have = (rows, ws, dests, buf)
            self._staging[fmt.row_bytes] = have
        return have[1], have[2]

    def close(self):
        """Releases every buffer (and the bootstrap when it was made here). Local: needs no peer. The memory is
        unmapped once no tensor taken from this object is alive. Idempotent."""
        self._closed = True
        self._mla, self._index, self._targets, self._pads, self._fence_state = [], [], [], [], None
        self._staging = {}
        for b in self._buffers:
            b.close()
        self._buffers = []
        if self._own_boot and self.bootstrap is not None:
            self.bootstrap.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
