"""Plan modes (SPEC section 4.1) and transport "auto" (SPEC section 5.1) through pcpkv_torch: exact rows of each
mode, published bytes that do not depend on the modes (the ops on the CPU, every replica), the choice of the
transport on faked topologies, and ValueErrors naming the argument."""


import pytest

from helpers import DEVICES, World, assert_bytes_equal, captured_logs, pk, torch

MODES = [(o, d) for o in pk.LOCAL_ORDERS for d in pk.DECODE_OWNERSHIPS]


def rows(plan):
    """Each rank's real rows as global token indices, in local order."""
    return [plan.global_index[r][:int(plan.num_local_tokens[r])].tolist() for r in range(plan.pcp_world)]


def written(plan):
    return [plan.global_index[r][plan.slot_mapping[r] >= 0].tolist() for r in range(plan.pcp_world)]


def test_fifteen_tokens_at_two_ranks():
    for own in pk.DECODE_OWNERSHIPS:
        req = pk.make_plan(2, [pk.Request(15)], decode_ownership=own)
        loc = pk.make_plan(2, [pk.Request(15)], local_order="local", decode_ownership=own)
        assert req.num_local_tokens.tolist() == [7, 8] and loc.num_local_tokens.tolist() == [7, 8]
        assert rows(req) == [[0, 1, 2, 3, 12, 13, 14], [4, 5, 6, 7, 8, 9, 10, 11]]
        assert rows(loc) == [[12, 13, 14, 0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]]
        assert loc.positions[0][:7].tolist() == [12, 13, 14, 0, 1, 2, 3]
        assert (loc.local_order, loc.decode_ownership) == ("local", own)


def test_three_decodes_round_robin():
    decodes = [pk.Request(1, 16, decode=True)] * 3
    for order in pk.LOCAL_ORDERS:
        rr = pk.make_plan(2, decodes, local_order=order, decode_ownership="round_robin")
        assert rows(rr) == [[0, 2], [1]] and written(rr) == [[0, 2], [1]]
        assert rr.decode_owner.tolist() == [0, 1, 0]
        assert rr.num_decode_tokens.tolist() == [2, 1] and rr.max_local_tokens == 2
        rep = pk.make_plan(2, decodes, local_order=order)
        assert rows(rep) == [[0, 1, 2], [0, 1, 2]] and written(rep) == [[0, 1, 2], []]


def mixed():
    # global tokens: request 0 -> 0..7, 1 -> 8, 2 (context 20) -> 9..14, 3 -> 15, 4 -> 16..20
    return [pk.Request(8), pk.Request(1, 40, decode=True), pk.Request(6, 20), pk.Request(1, 3, decode=True),
            pk.Request(5)]


def test_mixed_batch_with_continued_prefill():
    want = {
        ("request", "replicated"): [[0, 1, 6, 7, 8, 9, 10, 15, 16, 17], [2, 3, 4, 5, 8, 11, 12, 13, 14, 15, 18, 19, 20]],
        ("local", "replicated"): [[6, 7, 8, 9, 10, 15, 0, 1, 16, 17], [2, 3, 4, 5, 8, 11, 12, 13, 14, 15, 18, 19, 20]],
        ("request", "round_robin"): [[0, 1, 6, 7, 8, 9, 10, 16, 17], [2, 3, 4, 5, 11, 12, 13, 14, 15, 18, 19, 20]],
        ("local", "round_robin"): [[6, 7, 8, 9, 10, 0, 1, 16, 17], [2, 3, 4, 5, 11, 12, 13, 14, 15, 18, 19, 20]],
    }
    for (order, own), expect in want.items():
        p = pk.make_plan(2, mixed(), block_size=16, local_order=order, decode_ownership=own)
        assert rows(p) == expect, (order, own)
        assert p.decode_owner.tolist() == ([-1, 0, -1, 0, -1] if own == "replicated" else [-1, 0, -1, 1, -1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", ["direct", "staging"])
def test_published_bytes_identical_across_modes(device, transport):
    reqs = [pk.Request(2 * 3 * 13 + 5), pk.Request(1, 40, decode=True), pk.Request(17, 20),
            pk.Request(1, 3, decode=True), pk.Request(1, 77, decode=True), pk.Request(11)]
    fmt = pk.CacheFormat("fp8_ds_mla")
    worlds = {}
    for order, own in MODES:
        plan = pk.make_plan(3, reqs, block_size=16, extra_blocks=1, seed=5, local_order=order, decode_ownership=own)
        w = World(plan, fmt, device, seed=9)
        w.publish(transport)
        worlds[(order, own)] = w
    base = worlds[("request", "replicated")]
    ref = base.replica_bytes(0)
    assert int((ref[0] != 0xA5).sum()) > 0
    for (order, own), w in worlds.items():
        if (order, own) != ("request", "replicated"):
            assert rows(w.plan) != rows(base.plan), "the mode must change the rows (or this test cannot fail)"
        for r in range(3):
            for x, y, what in zip(w.replica_bytes(r), ref, ("mla", "index")):
                assert_bytes_equal(x, y, f"{order}/{own} {transport} replica {r} {what} vs request/replicated")
        # each held row's q_c_out equals the baseline's row of the same global token
        for r in range(3):
            for i, g in enumerate(rows(w.plan)[r]):
                br = next(b for b in range(3) if g in rows(base.plan)[b])
                bi = rows(base.plan)[br].index(g)
                assert torch.equal(w.local[r]["q_c_out"][i].cpu(), base.local[br]["q_c_out"][bi].cpu()), (order, own, g)


def test_bad_mode_names_raise_value_error():
    with pytest.raises(ValueError, match="local_order = 'fifo'"):
        pk.make_plan(2, [pk.Request(4)], local_order="fifo")
    with pytest.raises(ValueError, match="decode_ownership = 'round-robin'"):
        pk.make_plan(2, [pk.Request(4)], decode_ownership="round-robin")
    # the op itself refuses too (callers that skip the Python check)
    with pytest.raises(ValueError, match="decode_ownership: unknown decode ownership 'x'"):
        torch.ops.pcpkv.make_plan(2, 16, [0], [4], [0], 0, True, True, 0, "request", "x")
    from pcpkv_torch.models import BlockTables, StepBatch, StepRequest
    with pytest.raises(ValueError, match="local_order"):
        StepBatch(2, [StepRequest("a", torch.arange(4))], BlockTables(8, 16), local_order="vllm")
    # A step the plan refuses leaves the block tables as they were: it reserved the blocks and marked the tokens
    # cached, so the same request's next step was refused ("context_len = 0, but 3 tokens ... are cached").
    blocks = BlockTables(8, 16)
    with pytest.raises(ValueError, match=r"pcp_world \(--pcp\) = 0"):
        StepBatch(0, [StepRequest("a", torch.arange(3))], blocks)
    assert (blocks.tables, blocks.lengths, blocks.num_free) == ({}, {}, 7)
    assert StepBatch(2, [StepRequest("a", torch.arange(3))], blocks).num_tokens == 3


def topo(P, nccl=False):
    return dict(hosts=["node-a"] * P, peer_access=[[True] * P for _ in range(P)], nccl_available=nccl)


def test_auto_transport_on_faked_topologies():
    assert pk.choose_transport(**topo(4)) == (
        "direct", "direct: all 4 ranks on host node-a with peer access between every pair")
    t = topo(4, nccl=True)
    t["peer_access"][0][3] = False
    assert pk.choose_transport(**t) == (
        "collect", "collect over NCCL: rank 0 cannot store into rank 3's memory (no peer access)")
    t = topo(4, nccl=True)
    t["hosts"] = ["a", "a", "b", "b"]
    name, reason = pk.choose_transport(**t)
    assert name == "collect" and "2 hosts (a: ranks 0, 1; b: ranks 2, 3)" in reason
    t = topo(2)
    t["peer_access"] = torch.tensor([[True, False], [True, True]])
    with pytest.raises(ValueError, match="rank 0 cannot store into rank 1's memory .* NCCL is not available"):
        pk.choose_transport(**t)
    with pytest.raises(ValueError, match=r"peer_access must be \[3, 3\]"):
        pk.choose_transport(["a"] * 3, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="hosts"):
        pk.choose_transport("node-a", [[True]])
    # truth values before: "no" chose collect over NCCL, 0.4 and nan were peer access; a generator read as 0 hosts
    with pytest.raises(ValueError, match="nccl_available = 'no' must be True or False"):
        pk.choose_transport(["a", "b"], torch.zeros(2, 2, dtype=torch.bool), nccl_available="no")
    with pytest.raises(ValueError, match="peer_access: expected a bool tensor .* got torch.float32"):
        pk.choose_transport(["a", "a"], torch.tensor([[1.0, 0.4], [float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="hosts = <generator"):
        pk.choose_transport((h for h in ["a", "a"]), torch.ones(2, 2, dtype=torch.bool))


def test_resolve_transport_logs_the_reason():
    assert pk.resolve_transport("staging", topo(2)) == ("staging", "")
    with captured_logs() as lines:
        name, reason = pk.resolve_transport("auto", topo(2))
    assert name == "direct" and reason and any(reason in line for line in lines)
    with pytest.raises(ValueError, match="transport = 'p2p'"):
        pk.resolve_transport("p2p", topo(2))
