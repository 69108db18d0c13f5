"""Every rank agrees or every rank refuses: the setup-time checks that the ranks of one job share the same view.

A step that ranks take together first shares each rank's local verdict on its arguments (share_verdicts: a rank
with a bad argument still takes part, so no peer waits for it), then a small digest of what the ranks must agree
on (agree_on: sha256 of a canonical description; the descriptions themselves travel only on a mismatch). Both
raise ValueError on every rank with the same message, naming the rank(s), the field and the values, before
anything shared is written. `gather` is the exchange: str -> [world] str in rank order (pcpkv's bootstrap, or
the torch group's all_gather_object before the bootstrap exists); its own failure (a peer that exited, a
timeout) propagates as RuntimeError."""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Sequence

__all__ = ["share_verdicts", "agree_on", "first_difference"]

Gather = Callable[[str], Sequence[str]]


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
