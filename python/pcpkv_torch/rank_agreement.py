"""Every rank agrees or every rank refuses: the setup-time checks that the ranks of one job share the same view.

A step that ranks take together first shares each rank's local verdict on its arguments (share_verdicts: a rank
with a bad argument still takes part, so no peer waits for it), then a small digest of what the ranks must agree
on (agree_on: sha256 of a canonical description; the descriptions themselves travel only on a mismatch). Both
raise ValueError on every rank with the same message, naming the rank(s), the field and the values, before
anything shared is written. `gather` is the exchange: str -> [world] str in rank order (pcpkv's bootstrap, or
the torch group's all-gather before the bootstrap exists); its own failure (a peer that exited, a
timeout) propagates as RuntimeError."""

from __future__ import annotations

import hashlib
import json
import pickle
import time
from typing import Callable, Optional, Sequence

__all__ = ["share_verdicts", "agree_on", "share_verdicts_and_agree_on", "first_difference", "torch_gather",
           "arrival_check"]

Gather = Callable[[str], Sequence[str]]


def _wait_interruptibly(work) -> None:
    """work.wait(), polling: Python's signal handlers run between polls, so Ctrl-C raises KeyboardInterrupt at once
    (work.wait() and all_gather_object block in C++ until every peer arrives: Ctrl-C in SymmetricCaches' setup, a
    live peer not calling, was not handled 10 s on)."""
    pause = 1e-4
    while not work.is_completed():
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    work.wait()


def torch_gather(group, what: str, timeout_s: Optional[float] = None) -> Gather:
    """The exchange over a torch.distributed group (any picklable value, sent as all_gather_object sends it: two
    all-gathers, lengths then bytes, each waited for interruptibly; before pcpkv's bootstrap exists, or where there
    is none). Its failure (a peer gone) is RuntimeError naming `what` and this rank. With timeout_s, each exchange
    first runs arrival_check: a peer that does not arrive within timeout_s is named, not waited for."""
    import torch
    import torch.distributed as dist

    def gather(s) -> list:
        if timeout_s is not None:
            arrival_check(group, timeout_s, what)
        world = dist.get_world_size(group)
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        data = torch.frombuffer(bytearray(pickle.dumps(s)), dtype=torch.uint8)  # the ranks of one job: trusted
        try:
            n = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
            sizes = [torch.empty_like(n) for _ in range(world)]
            _wait_interruptibly(dist.all_gather(sizes, n, group=group, async_op=True))
            lengths = [int(x) for x in sizes]
            buf = torch.zeros(max(lengths), dtype=torch.uint8, device=dev)
            buf[:data.numel()] = data.to(dev)
            outs = [torch.empty_like(buf) for _ in range(world)]
            _wait_interruptibly(dist.all_gather(outs, buf, group=group, async_op=True))
        except Exception as e:  # noqa: BLE001 - gloo / NCCL errors when a peer is gone
            raise RuntimeError(f"{what}: the torch.distributed group's all-gather failed on rank "
                               f"{dist.get_rank(group)} (a peer exited or was killed?): {e}") from e
        return [pickle.loads(bytes(o[:k].cpu().clone().untyped_storage())) for o, k in zip(outs, lengths)]

    return gather


_ARRIVAL_TAG = 0x70637076  # 'pcpv': keeps the check's tokens apart from the caller's own point-to-point traffic
_STRANDED: list = []  # works of a failed check: a late peer may still complete them, so their buffers stay alive


def _global(group, r: int) -> int:
    """Rank r of group in the default group (what isend / irecv take in every torch 2.x)."""
    import torch.distributed as dist

    return r if group is None else dist.get_global_rank(group, r)


def _exchange(group, peers: list, value: int, timeout_s: float) -> tuple:
    """Sends `value` to every peer and receives one from each, at most timeout_s in all: ({peer: value received},
    {peer that sent nothing: why}, the works and buffers)."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    def why(r: int, e: Exception) -> str:  # gloo: our wait timed out, or the pair failed (closed, reset)
        if "timed out" in str(e).lower():
            return f"rank {r} did not arrive within timeout_s = {timeout_s} s"
        # gloo closes a pair whose wait timed out, on both sides: a peer that gave up looks like one that exited
        return (f"rank {r} left the group (it exited, was killed, or gave up waiting for this rank; gloo: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__})")

    mine, got = torch.full((1,), value, dtype=torch.int64), {r: torch.zeros(1, dtype=torch.int64) for r in peers}
    sends, recvs, missing = [], {}, {}
    for r in peers:  # posting on a pair gloo already closed raises at once
        try:
            sends.append(dist.isend(mine, _global(group, r), group=group, tag=_ARRIVAL_TAG))
            recvs[r] = dist.irecv(got[r], _global(group, r), group=group, tag=_ARRIVAL_TAG)
        except RuntimeError as e:
            missing[r] = why(r, e)
    deadline = time.monotonic() + min(float(timeout_s), 1e6)  # timedelta cannot hold inf
    for r, w in recvs.items():
        try:
            w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as e:
            missing[r] = why(r, e)
    for w in sends:  # a send to a peer that is not there may never complete: bounded, its failure is the recv's
        try:
            w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError:
            pass
    return {r: int(got[r]) for r in peers if r not in missing}, missing, (mine, got, sends, recvs)


_ARRIVED, _GAVE_UP = 1, 2


def arrival_check(group, timeout_s: float, what: str) -> None:
    """Every rank of a gloo group checks that every peer arrived, waiting at most timeout_s; a peer that did not is
    named in a RuntimeError on this rank ("rank 1 did not arrive within timeout_s = 3.0 s", or "left the group"
    when it gave up, was interrupted or its process exited). Each rank names the peers it misses itself: gloo's
    monitored_barrier bounds only rank 0's wait, while the others wait for rank 0 the group's own timeout (30 min
    by default) and learn no name. A second round carries each rank's verdict, so no rank goes on into the
    collective that follows while another has given up.
    The check runs over the process group's store (_store_arrival: polled, so Ctrl-C raises KeyboardInterrupt at
    once); where torch gives no store, over gloo point-to-point tokens (_gloo_arrival: bounded by timeout_s, but
    a wait in C++ that Ctrl-C does not end). Other backends: nothing (their collectives carry the group's
    timeout)."""
    import torch.distributed as dist

    if "gloo" not in str(dist.get_backend(group)) or dist.get_world_size(group) == 1:
        return
    store = _group_store(group)
    if store is None:
        _gloo_arrival(group, timeout_s, what)
    else:
        _store_arrival(group, store, timeout_s, what)


def _group_store(group):
    """The store of a torch.distributed group (keys set there are seen by its members only), None where this torch
    does not expose it."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    try:
        return c10d._get_process_group_store(group if group is not None else c10d._get_default_group())
    except Exception:  # noqa: BLE001 - private torch API: absent or changed, fall back to gloo tokens
        return None


def _store_arrival(group, store, timeout_s: float, what: str) -> None:
    """arrival_check over the group's store. Round 1: each rank sets its arrived key and polls for its peers'
    (short sleeps: Python's signal handlers run between polls). Round 2: each rank sets its verdict ("ok", or why
    it gave up: timed out, interrupted) and polls for every peer's. A peer whose process on this host has exited
    is named at once (its pid is in the store from any earlier check), not after timeout_s."""
    import os
    import socket

    import torch.distributed as dist

    me, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [r for r in range(world) if r != me]
    host = socket.gethostname()

    def fail(lines) -> RuntimeError:
        return RuntimeError(f"{what}: " + "; ".join(lines) + f" (seen from rank {me} of {world})")

    def store_op(fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a TCPStore whose serving process exited, a removed file store
            raise fail([f"the process group's store failed ({type(e).__name__}: {e}; the process serving it "
                        "exited?)"]) from e

    def left(r: int, why: str) -> str:
        return f"rank {r} left the group (it exited, was killed, or gave up waiting for a rank: {why})"

    def gave_up(why: str) -> None:  # told to the peers: they raise too instead of going on into the collective
        try:
            store.set(f"{base}/verdict/{me}", why)
            store.add(f"{base}/gave_up", 1)
        except Exception:  # noqa: BLE001 - a store that failed: the peers find that themselves
            pass

    def verdicts_of_those_who_gave_up() -> list:
        if store_op(store.add, f"{base}/gave_up", 0) == 0:
            return []
        out = []
        for r in peers:
            key = f"{base}/verdict/{r}"
            if store_op(store.check, [key]):
                v = store_op(store.get, key).decode()
                if v != "ok":
                    out.append(left(r, v))
        return out

    def exited(r: int) -> Optional[str]:
        key = f"pcpkv_arrival/pid/{r}"
        if not store_op(store.check, [key]):
            return None
        peer_host, pid = store_op(store.get, key).decode().split("\n")
        return left(r, f"its process {pid} has exited") if peer_host == host and not _alive(int(pid)) else None

    def wait_for(kind: str, missing_why: str) -> None:
        keys = {r: f"{base}/{kind}/{r}" for r in peers}
        deadline = time.monotonic() + min(float(timeout_s), 1e6)
        pause, next_look = 1e-4, time.monotonic() + 0.05
        while not store_op(store.check, list(keys.values())):
            now = time.monotonic()
            if now >= next_look or now >= deadline:  # who gave up, who exited: 20 times a second at most
                next_look = now + 0.05
                missing = [r for r in peers if not store_op(store.check, [keys[r]])]
                lines = verdicts_of_those_who_gave_up() + [x for x in map(exited, missing) if x]
                if not lines and now >= deadline:
                    lines = [f"rank {r} {missing_why} within timeout_s = {timeout_s} s" for r in missing]
                if lines:
                    gave_up("its timeout_s ran out before every rank arrived" if now >= deadline else
                            "a peer left the group")
                    raise fail(lines)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    # The checks this rank made on this group, counted in the group's store: every rank makes the same checks in
    # the same order, and a new group (a restarted job) starts again at 0 with its new store.
    base = f"pcpkv_arrival/{store_op(store.add, f'pcpkv_arrival/checks/{me}', 1)}"
    try:
        store_op(store.set, f"pcpkv_arrival/pid/{me}", f"{host}\n{os.getpid()}")
        store_op(store.set, f"{base}/arrived/{me}", "1")
        wait_for("arrived", "did not arrive")
        store_op(store.set, f"{base}/verdict/{me}", "ok")
        wait_for("verdict", "did not confirm its arrival")
        lines = verdicts_of_those_who_gave_up()
        if lines:
            raise fail(lines)
    except KeyboardInterrupt:
        gave_up("it was interrupted (KeyboardInterrupt)")
        raise


def _alive(pid: int) -> bool:
    """Whether process pid exists and is not a zombie (a killed rank its parent has not reaped yet)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 says whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _gloo_arrival(group, timeout_s: float, what: str) -> None:
    """arrival_check by gloo point-to-point tokens: every rank exchanges one token with every peer and waits at
    most timeout_s in all. gloo closes a pair whose wait timed out, so a late rank finds its connection to a peer
    that gave up closed; a second exchange carries each rank's verdict to the peers it did reach."""
    import torch
    import torch.distributed as dist

    me, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [r for r in range(world) if r != me]
    _, missing, works = _exchange(group, peers, 0, timeout_s)
    if missing:
        verdict, told = torch.full((1,), _GAVE_UP, dtype=torch.int64), []
        for r in peers:  # gloo closed the pairs whose wait timed out (their peers see that); the others are told
            try:
                told.append(dist.isend(verdict, _global(group, r), group=group, tag=_ARRIVAL_TAG))
            except RuntimeError:
                pass
        _STRANDED.append((works, verdict, told))
        raise RuntimeError(f"{what}: " + "; ".join(missing.values()) + f" (seen from rank {me} of {world})")
    verdicts, missing, works = _exchange(group, peers, _ARRIVED, timeout_s)
    missing.update({r: f"rank {r} gave up waiting for a rank (its timeout_s ran out before every rank arrived)"
                    for r, v in verdicts.items() if v == _GAVE_UP})
    if missing:
        _STRANDED.append(works)
        raise RuntimeError(f"{what}: " + "; ".join(missing[r] for r in sorted(missing)) +
                           f" (seen from rank {me} of {world})")


def share_verdicts(gather: Gather, what: str, why: str) -> None:
    """why: "" when this rank's arguments are good, else the reason naming the argument and value."""
    bad = [(r, w) for r, w in enumerate(gather(why)) if w]
    if bad:
        raise ValueError(f"{what}: " + "; ".join(f"bad argument on rank {r}: {w}" for r, w in bad))


def _canonical(fields: Sequence[tuple]) -> str:
    return json.dumps([[str(k), v] for k, v in fields], separators=(",", ":"), sort_keys=True)


def agree_on(gather: Gather, what: str, fields: Sequence[tuple]) -> None:
    """fields: ordered (name, JSON-able value) pairs this rank holds; every rank must hold the same."""
    text = _canonical(fields)
    _refuse_differing(gather, what, text, list(gather(hashlib.sha256(text.encode()).hexdigest())))


def share_verdicts_and_agree_on(gather: Gather, what: str, why: str,
                                fields: Callable[[], Sequence[tuple]]) -> None:
    """share_verdicts, then agree_on, in one exchange: each rank sends its digest (64 hex characters) followed by
    its verdict, so a check made on every call costs one gather, not two. fields() is called only where this
    rank's verdict is good."""
    text = "" if why else _canonical(fields())
    got = list(gather(hashlib.sha256(text.encode()).hexdigest() + why))
    share_verdicts(lambda _: [g[64:] for g in got], what, why)
    _refuse_differing(gather, what, text, [g[:64] for g in got])


def _refuse_differing(gather: Gather, what: str, text: str, digests: list) -> None:
    if len(set(digests)) == 1:
        return
    # every rank receives every description, so every rank raises the same message
    descs = [json.loads(t) for t in gather(text)]
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    raise ValueError(f"{what}: ranks disagree on {first_difference(descs[0], descs[other], 0, other)}")


def first_difference(a: list, b: list, ra: int, rb: int) -> str:
    """'<field>: rank ra <value>, rank rb <value>' for the first field where descriptions a and b differ."""
    for (ka, va), (kb, vb) in zip(a, b):
        if ka != kb:
            return f"the fields: rank {ra} {ka} = {va!r}, rank {rb} {kb} = {vb!r}"
        if va != vb:
            return f"{ka}: rank {ra} {va!r}, rank {rb} {vb!r}"
    return f"the number of fields: rank {ra} {len(a)}, rank {rb} {len(b)}"
