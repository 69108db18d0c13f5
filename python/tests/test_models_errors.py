"""Bad arguments of pcpkv_torch.models raise ValueError naming the argument, before any cache byte is written."""

import re

import pytest

from helpers import require_hf_models, torch

require_hf_models("glm_moe_dsa")
from pcpkv_torch.models import PcpModel, StepRequest, build_hf_model, small_config


@pytest.fixture(scope="module")
def model():
    return build_hf_model(small_config("glm-5", num_layers=2, hidden_size=128, num_heads=2, index_n_heads=2,
                                       vocab_size=64), seed=3)


def ids(n, seed=0):
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kwargs, match", [
    (dict(pcp_world=0), "pcp_world"), (dict(transport="p2p"), "transport"), (dict(kv_format="fp8_dsmla"), "kv_format"),
    (dict(block_size=24), "block_size"), (dict(num_blocks=1), "num_blocks"), (dict(row_chunk=0), "row_chunk"),
    (dict(scale_read="fp16"), "scale_read"),
    # 1 and 2 were refused later, by the cache table ("block_stride = 264 B must be a multiple of 16"), unnamed;
    # a seed torch cannot take raised "Overflow when unpacking long long"
    (dict(block_size=2), r"block_size = 2 must be a power of two >= 4"), (dict(block_size=1), "block_size = 1"),
    (dict(seed=-1), r"seed = -1 must be an int in \[0, 2\^64\)"), (dict(seed=1 << 64), "seed = 18446744073709551616"),
    (dict(seed=True), "seed = True"),
])
def test_constructor_refuses(model, kwargs, match):
    args = dict(pcp_world=2, num_blocks=8, block_size=16) | kwargs
    with pytest.raises(ValueError, match=match):
        PcpModel(model, **args)
    assert not any(type(layer.self_attn).__name__ == "PcpAttention" for layer in model.model.layers)


def test_step_refuses_before_writing(model):
    pcp = PcpModel(model, 2, num_blocks=8, block_size=16, poison=True)
    try:
        before = [m.clone() for m in pcp.world.mla[0]]
        bad = [
            ([StepRequest("a", ids(20)), StepRequest("a", ids(3))], "appears twice"),
            ([StepRequest("a", ids(2), context_len=0, decode=True)], "decode has 1 token"),
            ([StepRequest("a", ids(5), context_len=7)], "context_len = 7"),
            ([StepRequest("a", torch.zeros(0, dtype=torch.int64))], "token_ids"),
            ([StepRequest("a", torch.zeros(3))], "token_ids"),
            ([StepRequest("a", ids(3) + 64)], r"\[0, 64\)"),
            ([StepRequest("a", ids(200))], "cache blocks"),
        ]
        for reqs, match in bad:
            with pytest.raises(ValueError, match=match):
                pcp.step(reqs)
        with pytest.raises(ValueError, match="transport"):
            pcp.step([StepRequest("a", ids(4))], transport="nccl")
        for a, b in zip(before, pcp.world.mla[0]):
            assert torch.equal(a, b), "a refused step wrote cache bytes"
        pcp.step([StepRequest("a", ids(20))])
        with pytest.raises(ValueError, match="context_len = 0, but 20"):
            pcp.step([StepRequest("a", ids(4))])
        pcp.step([StepRequest("a", ids(1), context_len=20, decode=True)])
    finally:
        pcp.restore()
    with pytest.raises(RuntimeError, match="restore"):
        pcp.step([StepRequest("b", ids(4))])


def test_second_wrapper_refused(model):
    pcp = PcpModel(model, 2, num_blocks=8, block_size=16)
    try:
        with pytest.raises(ValueError, match="already a PcpAttention"):
            PcpModel(model, 2, num_blocks=8, block_size=16)
    finally:
        pcp.restore()


def test_dist_world_refuses_a_fence_timeout_it_cannot_pass_on():
    # inf raised OverflowError (int(inf * 1e6)) after the symmetric caches were mapped; 1e-9 reached the fence op as
    # timeout_us = 0 and failed at the first layer without naming fence_timeout_s. Checked before torch.distributed.
    from pcpkv_torch.models.dist_world import DistPcpWorld

    for bad in (float("inf"), 1e300, 1e-9, 0, -1.0, float("nan"), "5", True, 86400.5):
        with pytest.raises(ValueError, match=r"fence_timeout_s = .* must be a number of seconds in \[1e-06, 86400"):
            DistPcpWorld(None, 2, 1, 8, 16, max_positions=64, fence_timeout_s=bad)


@pytest.mark.parametrize("argv, match", [
    (["--timeout", "inf"], r"--timeout = inf must be in \[0.001, 86400\] seconds"),
    (["--timeout", "1e300"], "--timeout = 1e[+]300"), (["--timeout", "1e-9"], "--timeout = 1e-09"),
    (["--block-size", "2"], r"--block-size = 2 must be a power of two >= 4"),
    (["--seed", str(1 << 64)], r"--seed = 18446744073709551616 must be in"), (["--seed", "-1"], "--seed = -1"),
])
def test_examples_refuse_flags_before_any_work(argv, match, capsys, monkeypatch):
    # Each was a traceback (OverflowError, exit 1) or a message without the flag's name, after the model was built.
    from pcpkv_torch.examples import prefill, prefill_dist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as e:
        prefill_dist.parse(argv)
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    if argv[0] != "--timeout":  # prefill shares these checks
        with pytest.raises(SystemExit) as e:
            prefill.main(argv + ["--device", "cpu"])
        assert e.value.code == 2
        assert re.search(match, capsys.readouterr().err)


def test_examples_print_an_error_with_one_prefix(capsys):
    # A library error reached the examples' error line as "pcpkv: error: rank 0: pcpkv: rope: ...": the extension's
    # own "pcpkv: " (csrc/checks.h) after run_cli's. One prefix, then who, then the message.
    from pcpkv_torch.examples.prefill import run_cli

    def bad_rope():  # pcpkv::Error from the core, through translate_errors: ValueError "pcpkv: rope: ..."
        torch.ops.pcpkv.rope_table(0, "default", 10000.0, 1.0, 4096, 32.0, 1.0, 1.0, 1.0)

    def failed_run():
        raise RuntimeError("pcpkv: fence: timed out")

    def own_check():  # a message of the examples' own, without the prefix: kept whole
        raise ValueError("--tokens = 0 must be >= 1")

    for entry, who, code, line in [
            (bad_rope, "rank 0: ", 2, "pcpkv: error: rank 0: rope: num_positions = 0 must be >= 1"),
            (bad_rope, "", 2, "pcpkv: error: rope: num_positions = 0 must be >= 1"),
            (failed_run, "rank 3: ", 3, "pcpkv: error: rank 3: fence: timed out"),
            (own_check, "rank 1: ", 2, "pcpkv: error: rank 1: --tokens = 0 must be >= 1")]:
        assert run_cli(entry, who) == code
        assert capsys.readouterr().err == line + "\n"
