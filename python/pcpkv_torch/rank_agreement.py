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
import time
from typing import Callable, Sequence

__all__ = ["share_verdicts", "agree_on", "first_difference", "torch_gather"]

Gather = Callable[[str], Sequence[str]]


def _wait_interruptibly(work) -> None:
    """work.wait(), polling: Python's signal handlers run between polls, so Ctrl-C raises KeyboardInterrupt at once
    (work.wait() and all_gather_object block in C++ until every peer arrives, which a live peer that never calls
    makes the group's timeout, 30 minutes by default)."""
    pause = 1e-4
    while not work.is_completed():
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    work.wait()


def torch_gather(group, what: str) -> Gather:
    """The exchange over a torch.distributed group (two all-gathers, lengths then bytes, as all_gather_object does;
    before pcpkv's bootstrap exists, or where there is none). Its failure (a peer gone) is RuntimeError naming
    `what` and this rank; Ctrl-C while a peer has not arrived is KeyboardInterrupt within 100 ms."""
    import torch
    import torch.distributed as dist

    def gather(s: str) -> list:
        world = dist.get_world_size(group)
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        raw = str(s).encode()
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        try:
            n = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
            sizes = [torch.empty_like(n) for _ in range(world)]
            _wait_interruptibly(dist.all_gather(sizes, n, group=group, async_op=True))
            lengths = [int(x) for x in sizes]
            buf = torch.zeros(max(1, max(lengths)), dtype=torch.uint8, device=dev)
            buf[:data.numel()] = data.to(dev)
            outs = [torch.empty_like(buf) for _ in range(world)]
            _wait_interruptibly(dist.all_gather(outs, buf, group=group, async_op=True))
        except Exception as e:  # noqa: BLE001 - gloo / NCCL errors when a peer is gone
            raise RuntimeError(f"{what}: the torch.distributed group's all-gather failed on rank "
                               f"{dist.get_rank(group)} (a peer exited or was killed?): {e}") from e
        return [bytes(o[:k].cpu().tolist()).decode() for o, k in zip(outs, lengths)]

    return gather


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
    digests = list(gather(hashlib.sha256(text.encode()).hexdigest()))
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
