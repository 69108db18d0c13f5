"""pcpkv_torch.models.agreement.check on W ranks simulated by threads (an all-gather through a barrier): agreeing
ranks pass with one exchange; a disagreement raises the same message on every rank, naming the first differing
field, the request and each rank's value with the ranks grouped; a rank whose entries fail is named on the others;
the weights digest sees one changed element."""

import threading

import pytest

from helpers import torch
from pcpkv_torch.models import agreement


def run(entries_of, W=3):
    """({rank: "ok" | "Type: message"}, exchanges) of agreement.check on W threads (entries_of(rank) -> entries),
    through a str -> [W] str exchange as rank_agreement.torch_gather's."""
    slots, barrier, calls = [None] * W, threading.Barrier(W), [0]

    def gather(text):
        r = threading.get_ident()
        slots[ranks[r]] = text
        barrier.wait()
        out = list(slots)
        barrier.wait()
        if ranks[r] == 0:
            calls[0] += 1
        return out

    ranks, out = {}, {}

    def body(r):
        ranks[threading.get_ident()] = r
        try:
            agreement.check(gather, "test", lambda: entries_of(r))
            out[r] = "ok"
        except Exception as e:  # noqa: BLE001 - judged by the test
            out[r] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=body, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out, calls[0]


def step(rank, tokens):
    return [("requests (number)", 1), ("requests[0].request_id", "a"), ("requests[0].token_ids", tokens),
            ("requests[0].context_len", 0)]


def test_agreeing_ranks_pass_with_one_exchange():
    out, calls = run(lambda r: step(r, tuple(range(50))))
    assert out == {0: "ok", 1: "ok", 2: "ok"} and calls == 1


def test_a_disagreement_names_the_field_request_and_ranks_grouped():
    out, _ = run(lambda r: step(r, tuple(range(49)) + ((7,) if r == 1 else (49,))))
    want = ("Disagreement: test: the ranks disagree on requests[0] ('a').token_ids: ranks 0, 2: 50 values, [49] = "
            "49; rank 1: 50 values, [49] = 7")
    assert out == {0: want, 1: want, 2: want}


def test_a_missing_field_is_named_absent():
    out, _ = run(lambda r: [("seed", 0)] + ([("extra", 1)] if r == 2 else []))
    assert out[0] == "Disagreement: test: the ranks disagree on extra: ranks 0, 1: (absent); rank 2: 1", out


def test_a_rank_whose_entries_fail_is_named_on_the_others():
    def entries(r):
        if r == 1:
            raise ValueError("row_chunk = 0 must be an int >= 1 or None")
        return [("seed", 0)]

    out, _ = run(entries)
    assert out[1] == "ValueError: row_chunk = 0 must be an int >= 1 or None"
    for r in (0, 2):
        assert out[r] == ("Disagreement: test: rank 1 refused it: ValueError: row_chunk = 0 must be an int >= 1 or "
                          "None"), out


def test_the_weights_digest_sees_one_element():
    m = torch.nn.Linear(32, 7).to(torch.bfloat16)  # weight 448 B: hashed as int32 words; bias 14 B: as bytes
    seen = {agreement.module_digest(m)}
    for p, i in ((m.weight, (6, 31)), (m.bias, (6,))):
        with torch.no_grad():
            p[i] = -p[i] + 1
        seen.add(agreement.module_digest(m))
    assert len(seen) == 3
