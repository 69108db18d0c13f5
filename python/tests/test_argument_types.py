"""Arguments of the wrong type are a ValueError naming the argument and its value (issue 31, item 9): make_plan's
pcp_world=True made a 1-rank plan, a float raised the op's RuntimeError; one_process_topology(True) a TypeError."""

import re

import pytest

from helpers import pk, torch  # noqa: F401  (skips without torch / the extension)


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
