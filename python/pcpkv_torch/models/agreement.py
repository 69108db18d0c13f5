"""Every rank agrees or every rank refuses: what the ranks of a DistPcpModel must share (the setup's arguments, seed,
config and weights; each step's requests, cache state and fence epochs) is compared across the torch.distributed
group by a small digest before any work.

check(gather, what, entries) takes this rank's entries, an ordered list of (field, value) with plain values (int,
float, str, bool, None, bytes, tuples of them), and gather, pcpkv_torch.rank_agreement's exchange (torch_gather: str
-> [world] str). One exchange of a short string (verdict, number of entries, a 63-bit digest) settles the common
case. When the digests differ, or a rank could not even list its entries (its exception is its verdict), a second
exchange carries every rank's entries (only then) and every rank raises the same ValueError naming the first
differing field (and request) and each rank's value, ranks grouped by value and long sequences (token ids) shown
by length and first differing index, or the rank that failed and its message. (rank_agreement.agree_on compares
two ranks' whole values: a step's 100k token ids would fill the message.)
"""

from __future__ import annotations

import array
import base64
import hashlib
import pickle
from typing import Callable, Sequence

import torch

__all__ = ["Disagreement", "check", "digest", "module_digest", "step_entries"]

_MAX_VALUE_CHARS = 200  # a value in a message is cut past this (a 100k-token list would drown it)


class Disagreement(ValueError):
    """The ranks of one job disagree (or one refused its own input): raised on every rank, the same message."""


def _canon(v) -> bytes:
    """A byte encoding of a plain value that is equal on two ranks exactly when the values are."""
    if isinstance(v, tuple) and all(type(x) is int for x in v):  # token ids: fast
        try:
            return b"q(" + array.array("q", v).tobytes() + b")"
        except OverflowError:
            pass
    if isinstance(v, (tuple, list)):
        return b"(" + b",".join(_canon(x) for x in v) + b")"
    if isinstance(v, bytes):
        return b"b" + str(len(v)).encode() + b":" + v
    return type(v).__name__.encode() + b":" + repr(v).encode()


def digest(entries: Sequence[tuple[str, object]]) -> int:
    """A 63-bit digest of (field, value) entries (blake2b of their canonical encoding)."""
    h = hashlib.blake2b(digest_size=8)
    for name, value in entries:
        h.update(_canon((name, value)) + b";")
    return int.from_bytes(h.digest(), "little") >> 1


_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd, so (2i + 1) * _MIX is odd for every i
_CHUNK = 1 << 20
_WEIGHTS: dict = {}


def _weights(device) -> torch.Tensor:
    """int64 [_CHUNK]: (2i + 1) * _MIX, odd, wrapped mod 2^64 (cached per device)."""
    w = _WEIGHTS.get(str(device))
    if w is None:
        w = (torch.arange(_CHUNK, dtype=torch.int64, device=device) * 2 + 1) * _MIX
        _WEIGHTS[str(device)] = w
    return w


@torch.no_grad()
def module_digest(module: torch.nn.Module) -> str:
    """A hex digest of a module's state dict: every entry's name, dtype, shape and bytes. The bytes are hashed where
    they live (on the GPU for a GPU model: no copy to the host) as 32-bit words (bytes when the size is not a
    multiple of 4) times odd weights, summed mod 2^64 per chunk: a change of any one word always changes it."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        if t.numel() == 0:
            continue
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        try:
            words = b.view(torch.int32) if b.numel() % 4 == 0 else b
        except RuntimeError:  # a view whose offset is not 4-byte aligned: byte by byte
            words = b
        sums = []
        for i in range(0, words.numel(), _CHUNK):
            w = words[i:i + _CHUNK].to(torch.int64)
            sums.append((w * _weights(w.device)[:w.numel()]).sum())
        h.update(torch.stack(sums).cpu().numpy().tobytes())
    return h.hexdigest()


def _gather_object(gather, obj) -> list:
    text = base64.b64encode(pickle.dumps(obj)).decode("ascii")  # the ranks of one job: trusted peers
    return [pickle.loads(base64.b64decode(t)) for t in gather(text)]


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= _MAX_VALUE_CHARS else s[:_MAX_VALUE_CHARS] + f"... ({len(s)} characters)"


def _values(field: str, per_rank: list) -> str:
    """'rank 0: x; ranks 1, 2: y' (ranks grouped by value, in rank order of first appearance)."""
    groups: dict = {}
    for r, v in enumerate(per_rank):
        groups.setdefault(_canon(v), (v, []))[1].append(r)
    parts = []
    for v, ranks in groups.values():
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        parts.append(f"{who}: {_describe(field, v, per_rank)}")
    return "; ".join(parts)


_ABSENT = object()


def _describe(field: str, v, per_rank: list) -> str:
    if v is _ABSENT:
        return "(absent)"
    others = [o for o in per_rank if o is not _ABSENT]
    if isinstance(v, tuple) and len(v) > 8 and all(isinstance(o, tuple) for o in others):
        # a long sequence (token ids): its length and the first index where the ranks differ
        j = next((i for i in range(max(map(len, others))) if len({o[i] if i < len(o) else None
                                                                   for o in others}) > 1), None)
        at = f", [{j}] = {v[j] if j < len(v) else '(past the end)'}" if j is not None else ""
        return f"{len(v)} values{at}"
    return _show(v)


def _label(field: str, lists: list) -> str:
    """requests[1].token_ids -> requests[1] ('b').token_ids when every rank has that request_id there."""
    prefix, _, leaf = field.rpartition(".")
    ids = {_canon(lst.get(prefix + ".request_id", _ABSENT)) for lst in lists} if prefix else set()
    if leaf == "request_id" or len(ids) != 1 or (prefix + ".request_id") not in lists[0]:
        return field
    return f"{prefix} ({lists[0][prefix + '.request_id']!r}).{leaf}"


def step_entries(requests, transport, blocks) -> list:
    """What defines a PcpModel step: per request its id, token ids, context_len and decode; the transport
    override; and the cache state the step builds on (free blocks, cached tokens per request, a digest of the
    free list and tables): a rank whose earlier step ended otherwise than its peers' is named here."""
    out = [("requests (number)", len(requests)), ("transport", transport)]
    for i, q in enumerate(requests):
        t = getattr(q, "token_ids", None)
        rid = getattr(q, "request_id", None)
        out += [(f"requests[{i}].request_id", rid if isinstance(rid, (int, str)) else repr(rid)),
                (f"requests[{i}].token_ids", tuple(t.reshape(-1).tolist()) if isinstance(t, torch.Tensor)
                 and not t.dtype.is_floating_point else repr(t)),
                (f"requests[{i}].context_len", getattr(q, "context_len", None)),
                (f"requests[{i}].decode", getattr(q, "decode", None))]
    free, tables, lengths = blocks.snapshot()
    out += [("cache state: free blocks", len(free)),
            ("cache state: cached tokens per request", tuple(sorted((repr(r), n) for r, n in lengths.items()))),
            ("cache state: block tables digest",
             digest([("free", tuple(free))] + [(repr(r), tuple(t)) for r, t in sorted(tables.items(), key=repr)]))]
    return out


def check(gather, what: str, entries: Callable[[], list]) -> None:
    """Compares this rank's entries() with every rank's through gather (str -> [world] str, rank order:
    rank_agreement.torch_gather; collective: every rank calls it once for the same `what`).
    Raises Disagreement (ValueError) on every rank when they differ, naming `what`, the first differing field and
    the ranks' values; when entries() raises on any rank, every rank raises naming that rank and its message (that
    rank re-raises its own exception, its message prefixed by nothing)."""
    error = None
    try:
        mine = [(str(k), v) for k, v in entries()]
        d = digest(mine)
    except Exception as e:  # noqa: BLE001 - shared with every rank below, then re-raised here
        error, mine, d = e, [], 0
    summaries = list(gather(f"{int(error is not None)}:{len(mine)}:{d}"))
    if len(set(summaries)) == 1 and error is None:
        return
    payload = (type(error).__name__, str(error)) if error is not None else None
    try:
        everyone = _gather_object(gather, (payload, mine))
    except (pickle.PicklingError, TypeError, AttributeError):  # a value that cannot be pickled: sent as its repr
        everyone = _gather_object(gather, (payload, [(k, _show(v)) for k, v in mine]))
    failed = [(r, p) for r, (p, _) in enumerate(everyone) if p is not None]
    if failed:
        if error is not None:
            raise error
        r, (kind, msg) = failed[0]
        more = f" (and rank{'s' if len(failed) > 2 else ''} {', '.join(str(f[0]) for f in failed[1:])})" \
            if len(failed) > 1 else ""
        raise Disagreement(f"{what}: rank {r}{more} refused it: {kind}: {msg}")
    lists = [dict(e) for _, e in everyone]
    order = [k for k, _ in max((e for _, e in everyone), key=len)]
    for k in order:
        vals = [lst.get(k, _ABSENT) for lst in lists]
        if len({_canon(v) if v is not _ABSENT else b"\0absent" for v in vals}) > 1:
            raise Disagreement(f"{what}: the ranks disagree on {_label(k, lists)}: {_values(k, vals)}")
    raise Disagreement(f"{what}: the ranks' digests differ ({summaries}) but no field does")
