"""The run-time replica check (pcpkv_torch.models.replica_check) with the indexer cache at its own slots
(docs/spec.md 4.2 and 5.2): a step with a gathered_indexer_slot_mapping hashes each written row's MLA row at its MLA
slot and its indexer row at its indexer slot. The hash is the C++ definition (the fixed values of
tests/publish/test_replica_hash_own_index.cpp); only written indexer slots are read, never a padded block's padding;
W replicas written by the drop-in with an indexer_slot_mapping pass, and one flipped byte in one replica's indexer
slot raises naming the rank and both slots."""

import types

import pytest

from helpers import as_int64, replica_hash_pattern, torch
from test_vllm_dropin import BLOCK_SIZE, clone_outputs, vllm_inputs
from test_vllm_index_slots import INDEX_BLOCKS, index_slots_for, indexer_row, padded_index_cache

from pcpkv_torch.models.replica_check import ReplicaCheck, compare_hashes, slot_hashes
from pcpkv_torch.vllm import fused_norm_rope

W = 3


def test_the_own_slot_hash_is_the_cpp_definition():
    mla, idx = replica_hash_pattern()
    same = torch.tensor([5, 2, 7])
    # index_slots == slots: the one-slot hashes (a step without its own indexer slots hashes as before)
    assert slot_hashes(mla, idx, same, same.clone()).tolist() == slot_hashes(mla, idx, same).tolist() == [
        as_int64(0x410BA49A32B1B98E), as_int64(0x5BC997F4B7878A5E), as_int64(0x971960CA7DEF46AE)]
    assert slot_hashes(mla, idx, torch.tensor([5, -1, 7]), torch.tensor([1, 6, -1])).tolist() == [
        as_int64(0x79A4A14DD736F196), as_int64(0x8AB02EB017E51108), as_int64(0xB0752CA762797EE8)]


def test_bad_slots_are_refused_naming_the_entry():
    mla, idx = replica_hash_pattern()
    with pytest.raises(ValueError, match=r"index_slots\[1\] = 8 is outside \[0, 8\)"):
        slot_hashes(mla, idx, torch.tensor([5, 2]), torch.tensor([1, 8]))
    with pytest.raises(ValueError, match=r"slots\[0\] = -2 is outside \[0, 8\)"):
        slot_hashes(mla, idx, torch.tensor([-2]), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"index_slots: expected int64 \[2\]"):
        slot_hashes(mla, idx, torch.tensor([5, 2]), torch.tensor([1]))


def test_only_the_written_indexer_slots_bytes_are_hashed():
    """Every byte of a GUARD-free padded indexer cache flipped in turn: the bytes of a written indexer slot change
    exactly their entry's hash; padding past a block's rows and scales, and unwritten slots, change nothing."""
    gen = torch.Generator().manual_seed(31)
    mla = torch.randint(0, 256, (6, BLOCK_SIZE, 656), generator=gen, dtype=torch.uint8)
    idx, buf = padded_index_cache(INDEX_BLOCKS, BLOCK_SIZE, "cpu")
    buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    slots = torch.tensor([3, 40, -1, 17, 90])
    islots = torch.tensor([12, -1, 50, 17, 0])
    base = slot_hashes(mla, idx, slots, islots)
    owner = torch.full(buf.shape, -1, dtype=torch.int64)
    for e, i in enumerate(islots.tolist()):
        if i >= 0:
            b, o = divmod(i, BLOCK_SIZE)
            owner[b, o * 128:(o + 1) * 128] = e
            owner[b, BLOCK_SIZE * 128 + 4 * o:BLOCK_SIZE * 128 + 4 * o + 4] = e
    flat, own = buf.view(-1), owner.view(-1)
    for k in range(flat.numel()):
        flat[k] ^= 0x41
        h = slot_hashes(mla, idx, slots, islots)
        flat[k] ^= 0x41
        changed = (h != base).nonzero().flatten().tolist()
        assert changed == ([int(own[k])] if own[k] >= 0 else []), (k, changed)
    assert int((owner >= 0).sum()) == 4 * 132


def _replicas():
    """W replicas of one step written by the drop-in (fp8_ds_mla) with vLLM's indexer_slot_mapping: each its own MLA
    cache and its own padded indexer cache; the step's mappings as a PcpWorld step carries them."""
    a = vllm_inputs("cpu", "fp8_ds_mla", seed=21)
    isl = index_slots_for(a["slot_mapping"].cpu(), torch.Generator().manual_seed(22))
    mla, idx, bufs = [], [], []
    for _ in range(W):
        b = clone_outputs(a)
        b["indexer_k_cache"], buf = padded_index_cache(INDEX_BLOCKS, BLOCK_SIZE, "cpu")
        fused_norm_rope(**b, indexer_slot_mapping=isl)
        mla.append(b["mla_kv_cache"].view(torch.uint8))
        idx.append(b["indexer_k_cache"])
        bufs.append(buf)
    world = types.SimpleNamespace(W=W, mla=[mla], index=[idx])
    step = types.SimpleNamespace(gathered_slot_mapping=a["slot_mapping"], gathered_indexer_slot_mapping=isl)
    return world, step, bufs


def test_equal_replicas_pass_and_a_corrupt_indexer_slot_is_named():
    world, step, bufs = _replicas()
    check = ReplicaCheck(True)
    check.check_local(world, 0, step)  # equal replicas: passes
    assert check.layers == 1
    slots, islots = check.written(step)
    s_all, i_all = step.gathered_slot_mapping, step.gathered_indexer_slot_mapping
    assert slots.numel() == int(((s_all >= 0) | (i_all >= 0)).sum()) > int((s_all >= 0).sum())
    assert bool((slots < 0).any()) and bool((islots < 0).any())  # rows with one of the two caches only
    both = ((slots >= 0) & (islots >= 0) & (slots != islots)).nonzero().flatten()
    j = int(both[len(both) // 2])
    s, i = int(slots[j]), int(islots[j])
    data, scale = indexer_row(world.index[0][2], i)
    for byte in (data[7:8], scale[3:4]):  # one bit of rank 2's indexer data, then of its scale
        byte ^= 0x10
        with pytest.raises(RuntimeError, match=rf"replica check: layer 0: rank 2 differs from rank 0 at slot {s} "
                                               rf"\(indexer slot {i}\) \(first of 1 differing slots of the "
                                               rf"{slots.numel()} written"):
            check.check_local(world, 0, step)
        byte ^= 0x10
    # A row with an indexer row only (a padding token of the MLA mapping): named by its indexer slot.
    k = int((slots < 0).nonzero().flatten()[0])
    data, _ = indexer_row(world.index[0][1], int(islots[k]))
    data[100] ^= 0x01
    with pytest.raises(RuntimeError, match=rf"rank 1 differs from rank 0 at indexer slot {int(islots[k])} "
                                           rf"\(no MLA row\)"):
        check.check_local(world, 0, step)
    data[100] ^= 0x01
    # The padding of every indexer block of rank 1 (never written, not hashed): still passes.
    bufs[1][:, BLOCK_SIZE * 132:] ^= 0xFF
    check.check_local(world, 0, step)
    assert check.layers == 2  # the checks that passed


def test_compare_hashes_names_both_slots():
    h = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3]])
    with pytest.raises(RuntimeError, match=r"rank 2 differs from rank 0 at slot 41 \(no indexer row\) \(first of 1"):
        compare_hashes(h, torch.tensor([40, 41, 42]), 5, torch.tensor([7, -1, 9]))
    with pytest.raises(RuntimeError, match=r"layer 5: rank 2 differs from rank 0 at slot 41 \(first of 1"):
        compare_hashes(h, torch.tensor([40, 41, 42]), 5)
