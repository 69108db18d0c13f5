"""The run-time replica check (pcpkv_torch.models.replica_check) with W logical ranks in one process: off by
default, on with check_replicas=True or PCPKV_CHECK_REPLICAS=1; healthy replicas pass; one flipped bit in one
replica raises naming the layer, the rank and the slot. (Across processes: test_distributed_model.py.)"""

import functools

import pytest

from helpers import GUARD, as_int64, replica_hash_pattern, require_hf_models, torch

require_hf_models("glm_moe_dsa")
from pcpkv_torch.models import PcpModel, StepRequest, build_hf_model, small_config
from pcpkv_torch.models.replica_check import ENV, ReplicaCheck, slot_hashes


@functools.lru_cache(maxsize=None)
def model():
    return build_hf_model(small_config("glm-5", num_layers=3, index_topk=32, hidden_size=256), seed=3)


def prompt():
    return [StepRequest("a", torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(4)))]


def test_off_by_default_and_on_by_argument_or_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not ReplicaCheck().enabled and ReplicaCheck(True).enabled
    monkeypatch.setenv(ENV, "1")
    assert ReplicaCheck().enabled and not ReplicaCheck(False).enabled
    with pytest.raises(ValueError, match="check_replicas = 'yes'"):
        ReplicaCheck("yes")


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1", "1 ", "01", "on"])
def test_environment_value_other_than_0_1_or_empty_is_refused(monkeypatch, value):
    # As the C++ library (pcpkv::replica_check_from_env): a value that silently left the check off would hide the
    # divergence it was set to catch. An explicit argument does not read the variable.
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=rf"PCPKV_CHECK_REPLICAS: must be 1 \(on\) or 0 / empty / unset \(off\), "
                                         rf"got '{value}'"):
        ReplicaCheck()
    assert ReplicaCheck(True).enabled and not ReplicaCheck(False).enabled
    monkeypatch.setenv(ENV, "")
    assert not ReplicaCheck().enabled
    monkeypatch.setenv(ENV, "0")
    assert not ReplicaCheck().enabled
    monkeypatch.setenv(ENV, "y" * 500)
    with pytest.raises(ValueError, match=r"got 'y{200}' \(500 characters\)"):
        ReplicaCheck()


def test_every_single_byte_change_changes_the_hash():
    gen = torch.Generator().manual_seed(5)
    mla = torch.randint(0, 256, (2, 4, 656), generator=gen, dtype=torch.uint8)
    idx = torch.randint(0, 256, (2, 4, 132), generator=gen, dtype=torch.uint8)
    slots = torch.arange(8)
    base = slot_hashes(mla, idx, slots)
    for cache, pos in ((mla, (1, 2, 0)), (mla, (0, 3, 655)), (idx, (1, 0, 5)), (idx, (0, 3, 131))):
        for delta in (1, 128, 255):
            cache[pos] ^= delta
            h = slot_hashes(mla, idx, slots)
            cache[pos] ^= delta
            assert int((h != base).sum()) == 1, (pos, delta)


def test_the_hash_is_the_cpp_definition():
    """The values tests/publish/test_replica_hash.cpp (CPU oracle) and tests/publish/test_replica_hash_cuda.cpp
    (kernel) assert for the same bytes: the hash of docs/spec.md section 5.2 is one definition in C++, on the GPU and
    here."""
    mla, idx = replica_hash_pattern()
    slots = torch.tensor([5, 2, 7])
    assert slot_hashes(mla, idx, slots).tolist() == [as_int64(0x410BA49A32B1B98E), as_int64(0x5BC997F4B7878A5E),
                                                     as_int64(0x971960CA7DEF46AE)]
    assert slot_hashes(mla, None, slots).tolist() == [as_int64(0xE8A5D29897B52944), as_int64(0xA3848E0DAF67904E),
                                                      as_int64(0xB0752CA762797EE8)]


@pytest.mark.parametrize("transport", ["direct", "collect"])
def test_a_flipped_bit_is_named_and_healthy_replicas_pass(transport):
    pcp = PcpModel(model(), 2, num_blocks=12, block_size=16, transport=transport, check_replicas=True)
    try:
        pcp.step(prompt())  # healthy: passes
        publish, hit = pcp.world.publish, {}

        def corrupting(layer_idx, tr, local, step, *a, **k):
            publish(layer_idx, tr, local, step, *a, **k)
            if layer_idx == 0:  # an indexer layer: a bit of an indexer row (e4m3 byte 7)
                s = step.gathered_slot_mapping
                hit["slot"] = slot = int(s[s >= 0][3])
                pcp.world.index[0][1].view(-1)[(slot // 16) * 16 * 132 + (slot % 16) * 128 + 7] ^= 0x40

        pcp.world.publish = corrupting
        with pytest.raises(RuntimeError) as e:
            pcp.step([StepRequest("b", prompt()[0].token_ids[:40])])
        assert f"layer 0: rank 1 differs from rank 0 at slot {hit['slot']} (first of 1 differing" in str(e.value)
    finally:
        pcp.restore()
    assert int(pcp.world.mla[0][0][0].min()) == GUARD == int(pcp.world.mla[0][0][0].max())  # the null block: untouched
