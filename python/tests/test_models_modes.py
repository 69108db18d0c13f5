"""The whole-model PCP prefill (pcpkv_torch.models) under the plan modes (SPEC section 4.1) and transport "auto"
(section 5.1): logits of every step and every replica of every layer bit-identical to the default modes' and
to P = 1, and "auto" resolving to direct (the logical ranks share one device) with its reason."""

import pytest

from helpers import DEVICES, captured_logs, pk, torch
from test_models import MODELS, SCHEDULE, assert_replicas, run


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", ["collect", "direct"])
def test_modes_give_the_same_logits_and_caches(transport, device):
    model = MODELS[0]
    ref, ref_replicas, _ = run(model, device, 1, transport)
    for order in pk.LOCAL_ORDERS:
        for own in pk.DECODE_OWNERSHIPS:
            got, replicas, pcp = run(model, device, 3, transport, local_order=order, decode_ownership=own)
            assert (pcp.local_order, pcp.decode_ownership) == (order, own)
            for step, ((a, _), (b, _)) in enumerate(zip(got, ref)):
                assert torch.equal(a, b), f"{order}/{own} {transport} step {step}: logits differ from P=1"
            assert_replicas(replicas, ref_replicas, f"{order}/{own} {transport} P=3 vs P=1")
    print(f"\n{model} {transport}: P=3 under every plan mode == P=1 over {len(SCHEDULE)} steps")


@pytest.mark.parametrize("device", DEVICES)
def test_auto_transport_picks_direct_and_says_why(device):
    with captured_logs() as lines:
        auto, auto_replicas, pcp = run(MODELS[0], device, 2, "auto", schedule=SCHEDULE[:1])
    assert pcp.transport == "direct"
    assert pcp.transport_reason.startswith("direct: all 2 ranks on host")
    assert any(pcp.transport_reason in line for line in lines)
    direct, direct_replicas, _ = run(MODELS[0], device, 2, "direct", schedule=SCHEDULE[:1])
    assert torch.equal(auto[0][0], direct[0][0])
    assert_replicas(auto_replicas, direct_replicas, "auto vs direct")


def test_model_refuses_bad_modes():
    from test_models import hf_model
    from pcpkv_torch.models import PcpModel
    for kw, name in ((dict(local_order="fresh_last"), "local_order"), (dict(decode_ownership="owner"),
                                                                        "decode_ownership"),
                     (dict(transport="automatic"), "transport")):
        with pytest.raises(ValueError, match=name):
            PcpModel(hf_model(MODELS[0], "cpu"), 2, num_blocks=48, block_size=16, **kw)
