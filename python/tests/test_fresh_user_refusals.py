"""A fresh user's break test (issue 36's pyargs findings): each bad argument is a ValueError naming the argument and
its value, raised before anything is written (the poisoned caches and outputs keep every byte).

1. dispatch's fmt against the format its CacheTargets were built for (check_targets): an fp8 fmt wrote 576-byte rows
   into 656-byte fp8_ds_mla slots, raw tile scales went into pow2 caches, unnoticed.
2. targets / row_dests of another type (AttributeError), an eps given a str (the schema's RuntimeError),
   dequantize_mla's slots out of range (IndexError), validate_slots' num_slots = -1 (blamed slot_mapping[0]),
   allocate_fence_pads' num_barriers = 5000 (accepted; FenceState then said "expected [num_barriers=1, ...]").
3. block_size 1 and 2 at the first entry (make_plan, allocate_*): refused later by the cache table, unnamed.
"""

import re

import pytest

from helpers import GUARD, World, pk, torch
from pcpkv_torch.distributed import SymmetricCaches

FMT = pk.CacheFormat("fp8_ds_mla")


@pytest.fixture(scope="module")
def world():
    plan = pk.make_plan(2, [pk.Request(30), pk.Request(1, context_len=20, decode=True)], block_size=16)
    return World(plan, FMT, "cpu", seed=36)


def _snapshot(w):
    return [w.flat(t).clone() for t in w.mla + w.idx] + [w.local[0][k].clone() for k in ("q_c_out", "topk")]


def _refused_before_writing(w, match, **kw):
    w.poison()
    before = _snapshot(w)
    with pytest.raises(ValueError, match=match):
        w.dispatch(0, **kw)
    for i, (a, b) in enumerate(zip(before, _snapshot(w))):
        assert torch.equal(a, b), f"tensor {i} of the snapshot changed on a refused dispatch"


@pytest.mark.parametrize("call_fmt, differs", [
    (pk.CacheFormat("fp8"), "kv_format 'fp8' vs 'fp8_ds_mla'"),            # 576 B rows fit the 656 B slots
    (pk.CacheFormat("fp8_ds_mla", ds_mla_scale="raw"), "ds_mla_scale 'raw' vs 'pow2'"),  # same size, other bytes
    (pk.CacheFormat("fp8_ds_mla", has_indexer=False), "has_indexer False vs True"),      # the indexer rows skipped
])
def test_dispatch_refuses_a_fmt_other_than_the_targets_format(world, call_fmt, differs):
    w = world
    loc, wt = w.local[0], w.weights
    w.poison()
    before = _snapshot(w)
    args = dict(fmt=call_fmt, q_c=loc["q_c"], q_norm_w=wt["q_norm_w"], q_c_out=loc["q_c_out"],
                slot_mapping=loc["slot_mapping"], targets=w.targets)
    if call_fmt.has_indexer:
        args.update(index_k=loc["index_k"], index_ln_w=wt["index_ln_w"], index_ln_b=wt["index_ln_b"],
                    topk_fill=loc["topk"])
    pattern = (re.escape(f"dispatch: fmt = {call_fmt} does not write the format targets were built for, {FMT} "
                         f"({differs})"))
    with pytest.raises(ValueError, match=pattern):
        pk.dispatch(loc["kv"], loc["k_pe"], loc["positions"], wt["kv_norm_w"], w.rope_cos_sin, **args)
    for i, (a, b) in enumerate(zip(before, _snapshot(w))):
        assert torch.equal(a, b), f"tensor {i} of the snapshot changed on a refused dispatch"


def test_the_format_check_names_an_fp8_k_scale_and_takes_an_equal_format():
    plan = pk.make_plan(2, [pk.Request(12)], block_size=16)
    w = World(plan, pk.CacheFormat("fp8", k_scale=2.0), "cpu", seed=3)
    w.fmt = pk.CacheFormat("fp8", k_scale=0.5)
    _refused_before_writing(w, re.escape("(k_scale 0.5 vs 2.0)"), targets=w.targets)
    # an equal format built anew (not the targets' object) writes; fields a format does not read are not compared
    w.fmt = pk.CacheFormat("fp8", ds_mla_scale="raw", k_scale=2.0)
    w.poison()
    w.dispatch(0, targets=w.targets)
    assert not torch.equal(w.flat(w.mla[0]), torch.full_like(w.flat(w.mla[0]), GUARD))


def test_every_table_of_targets_records_its_format():
    # from_caches / from_pointers record it (EngineCaches, SymmetricCaches and VllmPcpPublisher build theirs so);
    # a table built by hand has none and is left to the op's geometry check
    plan = pk.make_plan(2, [pk.Request(12)], block_size=16)
    w = World(plan, FMT, "cpu")
    assert w.targets.fmt == FMT
    assert pk.CacheTargets(w.targets.host, w.targets.table, w.targets.tensors).fmt is None


@pytest.mark.parametrize("kw, match", [
    (lambda w: dict(targets=list(w.mla)), "dispatch: targets must be a CacheTargets (CacheTargets.from_caches or "
                                          "from_pointers) or None, got list"),
    (lambda w: dict(row_dests=list(w.staging)), "dispatch: row_dests must be a RowDests"),
    (lambda w: dict(targets=w.targets, index_eps="x"), "dispatch: index_eps = 'x' must be a float"),
    (lambda w: dict(targets=w.targets, index_eps=None), "dispatch: index_eps = None must be a float"),
    (lambda w: dict(targets=w.targets, index_hadamard=1), "dispatch: index_hadamard = 1 must be True or False"),
])
def test_dispatch_names_an_argument_of_the_wrong_type(world, kw, match):
    # Were: AttributeError ('list' object has no attribute 'table'), torch's schema RuntimeError ("Expected a value
    # of type 'float' for argument 'q_eps' but instead found type 'str'"), 1 taken for True
    _refused_before_writing(world, re.escape(match), **kw(world))


def test_dispatch_names_q_eps_given_a_str(world):
    # the break test's own call: torch's schema RuntimeError, which named the op's argument but raised no ValueError
    w, loc, wt = world, world.local[0], world.weights
    w.poison()
    before = _snapshot(w)
    with pytest.raises(ValueError, match=re.escape("dispatch: q_eps = 'x' must be a float")):
        pk.dispatch(loc["kv"], loc["k_pe"], loc["positions"], wt["kv_norm_w"], w.rope_cos_sin, fmt=FMT, q_c=loc["q_c"],
                    q_norm_w=wt["q_norm_w"], q_c_out=loc["q_c_out"], index_k=loc["index_k"],
                    index_ln_w=wt["index_ln_w"], index_ln_b=wt["index_ln_b"], slot_mapping=loc["slot_mapping"],
                    targets=w.targets, q_eps="x")
    for i, (a, b) in enumerate(zip(before, _snapshot(w))):
        assert torch.equal(a, b), f"tensor {i} of the snapshot changed on a refused dispatch"


def test_dequantize_names_a_slot_out_of_range():
    cache = pk.allocate_mla_cache(4, 16, "fp8_ds_mla", fill=0x11)
    with pytest.raises(ValueError, match=re.escape("dequantize_mla: slots[1] = 1000000 is out of range [0, 64)")):
        pk.dequantize_mla(cache, "fp8_ds_mla", slots=[3, 10**6])  # was IndexError: index out of range in self
    with pytest.raises(ValueError, match=re.escape("dequantize_indexer: slots[0] = -1 is out of range [0, 64)")):
        pk.dequantize_indexer(pk.allocate_indexer_cache(4, 16, fill=0x11), slots=torch.tensor([-1]))
    assert pk.dequantize_mla(cache, "fp8_ds_mla", slots=[63])[0].shape == (1, 512)


@pytest.mark.parametrize("kw, match", [(dict(num_slots=-1), "validate_slots: num_slots = -1 must be an integer >= 0"),
                                       (dict(num_slots=80.0), "validate_slots: num_slots = 80.0 must be an integer"),
                                       (dict(num_slots=80, null_block_size=-16), "null_block_size = -16"),
                                       (dict(num_slots=8, null_block_size=16), "null_block_size = 16 exceeds")])
def test_validate_slots_names_num_slots_not_a_slot(kw, match):
    # num_slots = -1 was "slot_mapping[0] = 32 is out of range [0, -1)"
    with pytest.raises(ValueError, match=re.escape(match)):
        pk.validate_slots(torch.tensor([32, 33, -1]), **kw)


@pytest.mark.parametrize("kw, match", [(dict(world=2, num_barriers=5000), "num_barriers = 5000 must be an integer in "
                                                                           "[1, 4096]"),
                                       (dict(world=2, num_barriers=0), "num_barriers = 0"),
                                       (dict(world=0), "world = 0 must be an integer in [1, 1024]"),
                                       (dict(world=1025), "world = 1025"), (dict(world=2.0), "world = 2.0")])
def test_allocate_fence_pads_names_a_count_fence_state_refuses(kw, match):
    # 5000 barriers were allocated, then FenceState.local said "expected ... [num_barriers=1, 2, world=2]"
    with pytest.raises(ValueError, match=re.escape(f"allocate_fence_pads: {match}")):
        pk.allocate_fence_pads(**kw)


def test_fence_state_local_takes_the_pads_own_barrier_count():
    pads = pk.allocate_fence_pads(2, num_barriers=5)
    state = pk.FenceState.local(pads)  # was refused: "expected a contiguous int64 [num_barriers=1, 2, world=2]"
    assert state.num_barriers == 5 and tuple(state.epochs.shape) == (2, 5)
    pk.fence(state, 4)
    assert [int(p[4, 1].sum()) for p in pads] == [2, 2]  # epoch 1 of barrier 4 from both ranks, in slot 1


@pytest.mark.parametrize("block_size", [1, 2])
def test_block_size_below_four_is_refused_at_the_first_entry(block_size):
    # Were taken, then refused by the cache table: "make_cache_targets: target 0: indexer cache: block_stride = 264 B
    # must be a multiple of 16". The rule is the CLI's --block-size one (pcpkv::block_size_problem).
    rule = f"= {block_size} must be a power of two >= 4"
    for call, named in ((lambda: pk.make_plan(2, [pk.Request(8)], block_size=block_size),
                         "make_plan: block_size (--block-size) "),  # as the plan's own refusals name it
                        (lambda: pk.allocate_mla_cache(4, block_size, "fp8_ds_mla"), "allocate_mla_cache: block_size "),
                        (lambda: pk.allocate_indexer_cache(4, block_size), "allocate_indexer_cache: block_size "),
                        (lambda: SymmetricCaches._check(1, 4, block_size, "fp8_ds_mla", None, True, 1, 0),
                         "block_size ")):
        with pytest.raises(ValueError, match=re.escape(named + rule)):
            call()
    assert torch.ops.pcpkv.block_size_problem(block_size).startswith("must be a power of two >= 4")
    assert torch.ops.pcpkv.block_size_problem(4) == ""


@pytest.mark.parametrize("block_size", [48, 0, -4])
def test_block_size_that_is_not_a_power_of_two_names_make_plan(block_size):
    with pytest.raises(ValueError, match=re.escape(f"block_size (--block-size) = {block_size} must be a power of two")):
        pk.make_plan(2, [pk.Request(8)], block_size=block_size)
    with pytest.raises(ValueError, match=re.escape(f"block_size = {block_size}")):
        pk.allocate_indexer_cache(4, block_size) if block_size > 0 else pk.layout.check_block_size(block_size)


def test_a_slot_in_block_0_is_written_by_dispatch_and_refused_by_validate_slots():
    # docs/python.md: the ops do not know whether the engine reserves a null block (reserve_null_block=False uses
    # block 0), so they write it; validate_slots(null_block_size=block_size) is the check that refuses it
    plan = pk.make_plan(2, [pk.Request(12)], block_size=16)
    w = World(plan, FMT, "cpu", seed=5)
    w.local[0]["slot_mapping"][0] = 3
    w.poison()
    w.dispatch(0, targets=w.targets)
    assert not torch.equal(w.mla[0][0, 3], torch.full((656,), GUARD, dtype=torch.uint8))
    with pytest.raises(ValueError, match=re.escape("slot_mapping[0] = 3 is in the null block [0, 16)")):
        pk.validate_slots(w.local[0]["slot_mapping"], plan.num_slots, null_block_size=16)


@pytest.fixture
def one_rank_group(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_transports_targets_carry_their_format_to_the_same_check(one_rank_group):
    # SymmetricCaches and EngineCaches (VllmPcpPublisher's) build their targets with from_caches: a dispatch through
    # them with another format meets check_targets, before any byte of their caches changes
    plan = pk.make_plan(1, [pk.Request(6)], block_size=8)
    w = World(plan, FMT, "cpu", seed=8)
    caches = SymmetricCaches(num_layers=2, num_blocks=plan.num_blocks, block_size=8, has_indexer=[True, False],
                             device="cpu", timeout_s=20.0)
    mla = [pk.allocate_mla_cache(plan.num_blocks, 8, "fp8_ds_mla", fill=GUARD).share_memory_()]
    idx = [pk.allocate_indexer_cache(plan.num_blocks, 8, fill=GUARD).share_memory_()]
    engine = pk.EngineCaches(mla, idx, [pk.CacheFormat("fp8_ds_mla", ds_mla_scale="raw")], timeout_s=20.0)
    try:
        assert [t.fmt for t in caches.targets] == caches.fmts and engine.targets[0].fmt == engine.fmts[0]
        for targets, theirs in ((caches.targets[1], caches.fmts[1]), (engine.targets[0], engine.fmts[0])):
            kept = [t.clone() for t in targets.tensors]
            with pytest.raises(ValueError, match=re.escape(f"dispatch: fmt = {FMT} does not write the format targets "
                                                           f"were built for, {theirs}")):
                w.dispatch(0, targets=targets)
            assert all(torch.equal(a, b) for a, b in zip(kept, targets.tensors))
    finally:
        caches.close()
        engine.close()
