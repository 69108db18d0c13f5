"""Arguments of the wrong type are a ValueError naming the argument and its value (issue 31, item 9): make_plan's
pcp_world=True made a 1-rank plan, a float raised the op's RuntimeError; one_process_topology(True) a TypeError."""

import re

import pytest

from helpers import pk, torch  # noqa: F401  (skips without torch / the extension)
from pcpkv_torch.distributed import SymmetricCaches


@pytest.mark.parametrize("kw, named", [
    (dict(pcp_world=True), "pcp_world = True"),
    (dict(pcp_world=2.0), "pcp_world = 2.0"),
    (dict(block_size=4.5), "block_size = 4.5"),
    (dict(extra_blocks="1"), "extra_blocks = '1'"),
    (dict(seed=None), "seed = None"),
    (dict(shuffle_blocks=1), "shuffle_blocks = 1"),
    (dict(requests=[pk.Request(4.5)]), "requests[0].num_new_tokens = 4.5"),
    (dict(requests=[pk.Request(8), pk.Request(1, 3, decode=1)]), "requests[1].decode = 1"),
    (dict(requests=[8]), "requests[0] = 8"),
    (dict(requests=None), "requests = None"),
])
def test_make_plan_names_an_argument_of_the_wrong_type(kw, named):
    args = dict(pcp_world=2, requests=[pk.Request(8)], block_size=16)
    args.update(kw)
    with pytest.raises(ValueError, match=re.escape(f"make_plan: {named}")):
        pk.make_plan(args.pop("pcp_world"), args.pop("requests"), **args)


def test_make_plan_still_takes_any_integral_and_iterable():
    a = pk.make_plan(2, (pk.Request(n) for n in (8, 5)), block_size=16, seed=3)
    b = pk.make_plan(2, [pk.Request(8), pk.Request(5)], block_size=16, seed=3)
    assert torch.equal(a.slot_mapping, b.slot_mapping) and a.pcp_world == 2


@pytest.mark.parametrize("bad", [True, 2.0, 0, "2"])
def test_one_process_topology_names_pcp_world(bad):
    from pcpkv_torch.transport import one_process_topology

    with pytest.raises(ValueError, match=f"pcp_world = {bad!r}"):
        one_process_topology(bad)


@pytest.mark.parametrize("seed", [-1, 2**64, -(2**63)])
def test_make_plan_refuses_a_seed_outside_uint64(seed):
    # Was: -1 taken silently as 2^64 - 1 (the op casts int64 to pcpkv's uint64 seed); 2^64 the op's RuntimeError
    # "Expected a value of type 'int' ... found type 'int'". The CLI's --seed range is [0, 2^64 - 1].
    with pytest.raises(ValueError, match=re.escape(f"make_plan: seed = {seed} is out of range [0, {2**64 - 1}]")):
        pk.make_plan(2, [pk.Request(40)], block_size=16, seed=seed)


def test_make_plan_takes_every_uint64_seed_as_the_cli_does():
    # Was: a seed in [2^63, 2^64) (valid for `pcpkv run --seed`) raised the op's RuntimeError. Its block tables are
    # those of the same seed as the op's two's-complement int64, which the C++ plan reads back as that uint64.
    big = 2**64 - 5
    a = pk.make_plan(2, [pk.Request(300)], block_size=16, seed=big)
    b = pk.make_plan(2, [pk.Request(300)], block_size=16, seed=7)
    assert not torch.equal(a.block_tables, b.block_tables)  # the seed reached the shuffle
    assert torch.equal(a.block_tables, pk.make_plan(2, [pk.Request(300)], block_size=16, seed=big).block_tables)


@pytest.mark.parametrize("topology", [None, "cuda", {"hosts": ["h"]}, {"hosts": ["h"], "peer_access": [[True]],
                                                                        "bogus": 1}])
def test_resolve_transport_auto_names_a_malformed_topology(topology):
    # Was: TypeError from choose_transport(**topology) ("argument after ** must be a mapping" / unexpected keyword)
    with pytest.raises(ValueError, match="topology = .* must be a dict of hosts, peer_access"):
        pk.resolve_transport("auto", topology)


@pytest.mark.parametrize("kw, named", [(dict(kv_format="fp8", has_indexer="no"), "has_indexer = 'no'"),
                                       (dict(kv_format="fp8", has_indexer=1), "has_indexer = 1"),
                                       (dict(kv_format=["fp8"]), "kv_format = ['fp8']")])
def test_transport_row_bytes_names_a_bad_argument(kw, named):
    # Was: has_indexer='no' (truthy) gave 720, the indexer row, where CacheFormat refuses it; a list kv_format was
    # a TypeError (unhashable)
    with pytest.raises(ValueError, match=re.escape(named)):
        pk.transport_row_bytes(**kw)


def test_cache_format_names_an_unhashable_kv_format():
    with pytest.raises(ValueError, match=re.escape("kv_format = ['fp8']")):
        pk.CacheFormat(["fp8"])


@pytest.mark.parametrize("peer_access, named", [
    ([[1, 1], [1, 1]], "got torch.int64"),                 # was: taken as True (as a float tensor's 0.4 had been)
    ([[0.4, float("nan")], [1.0, 1.0]], "got torch.float32"),
    ([["yes", "yes"], ["yes", "yes"]], "peer_access = [['yes'"),  # was: torch's "too many dimensions 'str'"
    ([[True], [True, True]], "peer_access = [[True], [True, True]]"),  # was: torch's "expected sequence of length"
    (None, "peer_access = None"),                           # was: TypeError
    (torch.ones(2, 2, dtype=torch.bool, device="meta"), "on meta"),  # was: NotImplementedError
])
def test_choose_transport_names_peer_access_that_is_not_bools(peer_access, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        pk.choose_transport(["h0", "h0"], peer_access)


def test_choose_transport_still_takes_nested_bools_and_arrays():
    import numpy as np

    assert pk.choose_transport(["h0", "h0"], [[True, True], [True, True]])[0] == "direct"
    assert pk.choose_transport(["h0", "h0"], np.ones((2, 2), dtype=bool))[0] == "direct"
    with pytest.raises(ValueError, match=re.escape("peer_access must be [0, 0]")):
        pk.choose_transport([], [])  # the shape is still the op's to name


@pytest.mark.parametrize("num_barriers", [0, 2**40, 4097, 2.0, True])
def test_num_barriers_outside_the_fence_cap_is_named(num_barriers):
    # 2**40 reached the pad allocation and failed there with the allocator's RuntimeError (break test)
    with pytest.raises(ValueError, match=r"num_barriers = .* must be an integer in \[1, 4096\]"):
        pk.FenceState([8, 4096], world=2, num_barriers=num_barriers)
    with pytest.raises(ValueError, match=r"num_barriers = .* must be an integer in \[1, 4096\]"):
        SymmetricCaches._check(1, 4, 64, "fp8_ds_mla", None, True, num_barriers, 0)
