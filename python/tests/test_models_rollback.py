"""A PcpModel step that fails part-way leaves nothing behind (issue 31 item 2): its blocks go back (free count and
order), no token is marked cached, the last step's top-k stays; the same step retried gives the clean run's logits.
What no kernel can run (index_topk, index_n_heads past the indexer's bounds) is refused by the constructor, and a
prompt past max_position_embeddings before any block is reserved."""

import pytest

from helpers import require_hf_models, torch

require_hf_models("glm_moe_dsa")
from pcpkv_torch.models import PcpModel, StepRequest, build_hf_model, small_config

NUM_BLOCKS, BLOCK = 16, 16  # 15 free: block 0 is the null block


@pytest.fixture(scope="module")
def model():
    return build_hf_model(small_config("glm-5", num_layers=3, hidden_size=128, num_heads=2, index_n_heads=2,
                                       index_topk=16, vocab_size=64), seed=5)


def ids(n, seed=0):
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def pcp_of(model, **kw):
    return PcpModel(model, 2, num_blocks=NUM_BLOCKS, block_size=BLOCK, record_topk=True, poison=True, **kw)


@pytest.mark.parametrize("field, value", [("index_topk", 10000), ("index_n_heads", 200), ("index_topk", 8193),
                                          ("index_n_heads", 129)])
def test_constructor_refuses_what_no_kernel_runs(model, field, value):
    # Accepted before: the step failed in the first layer's indexer, its blocks kept and its tokens marked cached.
    old = getattr(model.config, field)
    setattr(model.config, field, value)
    try:
        with pytest.raises(ValueError, match=rf"hf_model.config.{field} = {value} must be an int in \[1, "):
            pcp_of(model).restore()  # built (before the fix): released, so the next case starts from HF's attention
    finally:
        setattr(model.config, field, old)
    assert not any(type(layer.self_attn).__name__ == "PcpAttention" for layer in model.model.layers)


@pytest.mark.parametrize("field, value, message", [
    ("num_blocks", 2.5, r"num_blocks = 2.5 must be an int >= 2"),  # was a TypeError from torch.randperm
    ("max_positions", 0, r"max_positions = 0 must be an int >= 1 or None"),  # was rope_table's num_positions
    ("max_positions", 64.0, r"max_positions = 64.0 must be an int >= 1 or None")])
def test_constructor_names_a_bad_size_argument(model, field, value, message):
    # issue 31's break test (item 9's num_blocks=4.5 for PcpModel): a ValueError naming the caller's argument
    kw = {"num_blocks": NUM_BLOCKS, "block_size": BLOCK, field: value}
    with pytest.raises(ValueError, match=message):
        PcpModel(model, 2, **kw).restore()
    assert not any(type(layer.self_attn).__name__ == "PcpAttention" for layer in model.model.layers)


def test_an_unhashable_request_id_is_named(model):
    pcp = pcp_of(model)  # issue 31's break test: a list request_id was a TypeError from set()
    try:
        with pytest.raises(ValueError, match=r"requests\[0\].request_id = \['x'\] must be hashable"):
            pcp.step([StepRequest(["x"], ids(3))])
        assert pcp.blocks.num_free == NUM_BLOCKS - 1 and pcp.blocks.lengths == {}
    finally:
        pcp.restore()


def test_prompt_past_max_position_embeddings_reserves_nothing(model):
    # The case: 15 -> 12 free blocks and "a" recorded as 40 tokens cached; the next step with
    # context_len = 40 was accepted and attended to slots never written.
    old = model.config.max_position_embeddings
    model.config.max_position_embeddings = 32
    try:
        pcp = pcp_of(model)
    finally:
        model.config.max_position_embeddings = old
    try:
        assert pcp.blocks.num_free == 15
        with pytest.raises(ValueError, match=r"requests\[0\] \('a'\): positions \[0, 40\) reach past "
                                             r"max_position_embeddings = 32"):
            pcp.step([StepRequest("a", ids(40))])
        assert pcp.blocks.num_free == 15 and pcp.blocks.lengths == {} and pcp.blocks.tables == {}
        with pytest.raises(ValueError, match="context_len = 40, but 0 tokens"):
            pcp.step([StepRequest("a", ids(1, 1), context_len=40, decode=True)])
        pcp.step([StepRequest("a", ids(32))])  # up to the bound: served
        assert pcp.blocks.lengths == {"a": 32}
    finally:
        pcp.restore()


def _schedule():
    a, b = ids(50, 1), ids(30, 2)
    return [[StepRequest("a", a[:20])], [StepRequest("a", a[20:50], context_len=20), StepRequest("b", b)]]


class Boom(RuntimeError):
    pass


def boom(*_):
    raise Boom("boom")


def test_a_step_failing_in_the_forward_rolls_back_and_retries_clean(model):
    first, second = _schedule()
    ref = pcp_of(model)
    try:  # the clean run
        ref.step(first)
        want, _ = ref.step(second)
        want_topk = [ref.topk_positions(layer) for layer in (0, 1)]
    finally:
        ref.restore()

    pcp = pcp_of(model)
    try:
        pcp.step(first)
        free, lengths = pcp.blocks.num_free, dict(pcp.blocks.lengths)
        tables = {r: list(t) for r, t in pcp.blocks.tables.items()}
        topk = [pcp.topk_positions(layer) for layer in (0, 1)]
        # An exception inside the forward: in layer 2's MLP, after layers 0 and 1 published, ran their indexer
        # (new top-k recorded) and layer 2 published its rows into the new blocks.
        hook = model.model.layers[2].mlp.register_forward_pre_hook(boom)
        try:
            with pytest.raises(Boom):
                pcp.step(second)
        finally:
            hook.remove()
        assert pcp.blocks.num_free == free, "the failed step kept its blocks"
        assert pcp.blocks.lengths == lengths and pcp.blocks.tables == tables, "the failed step marked tokens cached"
        for layer in (0, 1):
            assert torch.equal(pcp.topk_positions(layer), topk[layer]), "the failed step's top-k stayed"
        with pytest.raises(ValueError, match="context_len = 50, but 20 tokens"):  # what the old message invited
            pcp.step([StepRequest("a", ids(1, 3), context_len=50, decode=True)])
        got, _ = pcp.step(second)  # the retry
        assert torch.equal(got, want), "the retried step's logits differ from the clean run's"
        for layer in (0, 1):
            assert torch.equal(pcp.topk_positions(layer), want_topk[layer])
    finally:
        pcp.restore()


def test_staging_buffers_alternate_per_call_across_steps(model, monkeypatch):
    # layer % 2 chose the buffer: with 3 layers, layer 2 of one step and layer 0 of the next both used buffer 0
    # back to back, so a rank one layer ahead could overwrite rows a peer was still combining (found by review)
    from pcpkv_torch.models import world as world_mod

    used = []
    real = world_mod.combine

    def record(workspace, *args, **kw):
        used.append(workspace.data_ptr())
        return real(workspace, *args, **kw)

    monkeypatch.setattr(world_mod, "combine", record)
    pcp = pcp_of(model, transport="staging")
    try:
        pcp.step([StepRequest("a", ids(12))])
        pcp.step([StepRequest("b", ids(9, seed=1))])
    finally:
        pcp.restore()
    per_call = used[::2]  # two logical ranks combine per layer; rank 0's workspace names the buffer
    assert len(per_call) == 6, used
    assert all(a != b for a, b in zip(per_call, per_call[1:])), per_call
