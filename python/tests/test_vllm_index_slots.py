"""The indexer cache at its own slots (docs/spec.md 4.2, issue 35 item 3): vLLM's indexer_slot_mapping through the
drop-in (pcpkv_torch.vllm.fused_norm_rope) and VllmPcpPublisher, into an indexer cache of its own block count with a
padded block stride.

The expected caches are built from the one-slot form (pcpkv's CPU oracle / the publisher as before): the same tokens'
rows, moved byte for byte to their indexer slots; every other byte (guards, block padding, unwritten slots) stays
GUARD. Both caches are compared whole.
"""

import pytest

from helpers import DEVICES, GUARD, torch
from dist_ranks import run_ranks
from test_vllm_dropin import BLOCK_SIZE, T, clone_outputs, vllm_inputs

from pcpkv_torch.vllm import fused_norm_rope

INDEX_BLOCKS = 4      # the indexer cache's own block count (the MLA cache has 6)
INDEX_PAD = 48        # bytes past a block's rows and scales (a padded block stride, as vLLM's hybrid allocator gives)


def padded_index_cache(num_blocks, block_size, device):
    """uint8 [num_blocks, block_size, 132] whose blocks lie INDEX_PAD bytes apart beyond their rows, in a GUARD-filled
    buffer (returned too, to compare whole)."""
    buf = torch.full((num_blocks, block_size * 132 + INDEX_PAD), GUARD, dtype=torch.uint8, device=device)
    return buf[:, :block_size * 132].view(num_blocks, block_size, 132), buf


def indexer_row(cache, slot):
    """(data 128 B, scale 4 B) of slot in an indexer cache [num_blocks, block_size, 132] (SPEC section 3 layout)."""
    bs = cache.shape[1]
    block = cache[slot // bs].reshape(-1)
    o = slot % bs
    return block[o * 128:(o + 1) * 128], block[bs * 128 + 4 * o:bs * 128 + 4 * o + 4]


def index_slots_for(slots, gen):
    """Indexer slots in [0, INDEX_BLOCKS * BLOCK_SIZE), distinct, unrelated to the MLA slots; -1 on two tokens whose
    MLA row lands and on one padding token of the MLA mapping it keeps (its indexer row lands without an MLA row)."""
    n = INDEX_BLOCKS * BLOCK_SIZE
    isl = torch.randperm(n, generator=gen)[:T]
    written = (slots >= 0).nonzero().flatten()
    isl[written[:2]] = -1
    return isl


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["fp8_ds_mla", "auto", "fp8"])
def test_dropin_writes_the_indexer_rows_at_their_own_slots(device, kv_dtype):
    a = vllm_inputs(device, kv_dtype, seed=3)
    gen = torch.Generator().manual_seed(11)
    slots = a["slot_mapping"].cpu()
    isl = index_slots_for(slots, gen)
    # The reference: the one-slot form with every token written at its own MLA-cache-sized slot (distinct, all >= 0),
    # so every token's rows exist to be moved.
    ref = clone_outputs(a)
    all_slots = torch.randperm(ref["mla_kv_cache"].shape[0] * BLOCK_SIZE, generator=gen)[:T]
    ref["slot_mapping"] = all_slots.to(device)
    fused_norm_rope(**ref)
    # The call under test: MLA rows by slot_mapping, indexer rows by indexer_slot_mapping into a smaller padded cache.
    b = clone_outputs(a)
    idx, buf = padded_index_cache(INDEX_BLOCKS, BLOCK_SIZE, device)
    b["indexer_k_cache"] = idx
    got = fused_norm_rope(**b, indexer_slot_mapping=isl.to(device))
    assert got is b["q_c_out"]
    assert torch.equal(b["q_c_out"].cpu(), ref["q_c_out"].cpu())
    assert torch.equal(b["topk_indices_buffer"].cpu(), ref["topk_indices_buffer"].cpu())
    # Expected caches, whole: GUARD, then each token's rows of the reference at its slots.
    mla_ref, mla_got = ref["mla_kv_cache"].view(torch.uint8).cpu(), b["mla_kv_cache"].view(torch.uint8).cpu()
    want_mla = torch.full_like(mla_got, GUARD)
    want_buf = torch.full_like(buf.cpu(), GUARD)
    want_idx = want_buf[:, :BLOCK_SIZE * 132].view(INDEX_BLOCKS, BLOCK_SIZE, 132)
    ref_idx = ref["indexer_k_cache"].cpu()
    bs = BLOCK_SIZE
    for t in range(T):
        r = int(all_slots[t])
        if slots[t] >= 0:
            s = int(slots[t])
            want_mla[s // bs, s % bs] = mla_ref[r // bs, r % bs]
        if isl[t] >= 0:
            d, sc = indexer_row(want_idx, int(isl[t]))
            rd, rsc = indexer_row(ref_idx, r)
            d.copy_(rd)
            sc.copy_(rsc)
    assert torch.equal(mla_got, want_mla), "MLA cache"
    assert torch.equal(buf.cpu(), want_buf), f"indexer cache: {int((buf.cpu() != want_buf).sum())} bytes differ"


def test_dropin_single_slot_forms_are_one_and_the_same():
    """indexer_slot_mapping=None and =slot_mapping itself write exactly what they wrote before (one slot for both)."""
    a = vllm_inputs("cpu", "fp8_ds_mla", seed=4)
    b, c = clone_outputs(a), clone_outputs(a)
    fused_norm_rope(**a)
    fused_norm_rope(**b, indexer_slot_mapping=b["slot_mapping"])
    fused_norm_rope(**c, indexer_slot_mapping=c["slot_mapping"].clone())  # equal values, its own tensor
    for k in ("mla_kv_cache", "indexer_k_cache", "q_c_out", "topk_indices_buffer"):
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k


def _dup(isl):
    """isl with its second written entry repeating its first."""
    isl = isl.clone()
    w = (isl >= 0).nonzero().flatten()
    isl[w[1]] = isl[w[0]]
    return isl


def _out_of_range(isl):
    isl = isl.clone()
    isl[(isl >= 0).nonzero().flatten()[0]] = INDEX_BLOCKS * BLOCK_SIZE
    return isl


@pytest.mark.parametrize("change,text", [
    (lambda isl: dict(indexer_slot_mapping=isl.to(torch.int32)), "indexer_slot_mapping: expected None or int64 [24]"),
    (lambda isl: dict(indexer_slot_mapping=isl[:-1]), "indexer_slot_mapping: expected None or int64 [24]"),
    (lambda isl: dict(indexer_slot_mapping=_out_of_range(isl)), "is out of range [0, 64) (or -1 to skip)"),
    (lambda isl: dict(indexer_slot_mapping=_dup(isl)), "duplicates indexer_slot_mapping["),
    # its own num_blocks, never its own block_size
    (lambda isl: dict(indexer_slot_mapping=isl, indexer_k_cache=torch.full((8, 8, 132), GUARD, dtype=torch.uint8)),
     "indexer_k_cache: has (num_blocks, block_size) = (8, 8) but mla_kv_cache (6, 16)"),
])
def test_dropin_refuses_bad_indexer_slots_before_any_write(change, text):
    a = vllm_inputs("cpu", "fp8_ds_mla", seed=5)
    isl = index_slots_for(a["slot_mapping"], torch.Generator().manual_seed(12))
    b = clone_outputs(a)
    b["indexer_k_cache"], _ = padded_index_cache(INDEX_BLOCKS, BLOCK_SIZE, "cpu")
    b.update(change(isl))
    before = {k: b[k].clone() for k in ("mla_kv_cache", "indexer_k_cache", "q_c_out", "topk_indices_buffer")}
    with pytest.raises(ValueError) as e:
        fused_norm_rope(**b)
    assert "indexer_" in str(e.value) and text in str(e.value), str(e.value)
    for k, v in before.items():
        assert torch.equal(b[k], v), f"{k} written before the refusal"


# ---- VllmPcpPublisher -------------------------------------------------------------------------------------------


def _publisher_run(rank, world, kv_cache_dtype, transports):
    """One layer with an indexer, two steps (prefills; decodes + a chunked prefill), published twice per transport:
    one slot for both caches (plain caches), and the indexer rows at their own slots (an indexer cache of its own
    block count, padded). Returns per transport what matched."""
    import test_vllm_publish as vp
    import torch.distributed as dist
    from pcpkv_torch.vllm import VllmPcpPublisher

    ib = 30  # the indexer cache's own blocks (the MLA cache has vp.NUM_BLOCKS = 24)
    blocks, iblocks = vp._blocks(), {}
    perm = torch.randperm(ib - 1, generator=torch.Generator().manual_seed(9)) + 1
    for rid in range(4):
        iblocks[rid] = perm[4 * rid:4 * rid + 4].tolist()
    res = {}
    for transport in transports:
        plain_mla, plain_idx = vp._engine_caches(kv_cache_dtype, "cpu", True)
        own_mla, _ = vp._engine_caches(kv_cache_dtype, "cpu", True)
        buf = torch.full((ib, vp.BS * 132 + INDEX_PAD), GUARD, dtype=torch.uint8).share_memory_()
        own_idx = [buf[:, :vp.BS * 132].view(ib, vp.BS, 132) if has else None for has in vp.LAYERS]
        pubs = [VllmPcpPublisher(m, i, kv_cache_dtype=kv_cache_dtype, max_num_tokens=48, transport=transport,
                                 mla_k_scale=0.5, check=True, timeout_s=60.0)
                for m, i in ((plain_mla, plain_idx), (own_mla, own_idx))]
        dist.barrier()
        pairs = []  # (slot, indexer slot) of every written row
        for s, reqs in enumerate(vp.STEPS[:2]):
            rows, sm, nd = vp.vllm_step(world, reqs, blocks)
            ism, _, _ = None, None, None
            _, ism, _ = vp.vllm_step(world, reqs, iblocks)
            M = len(rows[0])
            pairs += [(int(a), int(b)) for a, b in zip(sm.tolist(), ism.tolist()) if a >= 0]
            layer, has = 0, vp.LAYERS[0]
            x = vp.Inputs(layer, has)
            pos, qkv, ik = x.rows(rows[rank], 1000 * s + rank)
            q_c, kv, pe = vp._splits(qkv)
            for k, pub in enumerate(pubs):
                topk = torch.full((M, vp.TOPK), 0, dtype=torch.int32)
                pub.publish(layer, pos, q_c, x.w["q"], 1e-6, kv, x.w["kv"], 1e-6, pe, x.cos_sin, ik, x.w["ln_w"],
                            x.w["ln_b"], 1e-6, x.cos_sin.clone(), topk, sm, nd,
                            indexer_slot_mapping=ism if k == 1 else None)
        dist.barrier()
        # The own-slot caches: the plain MLA cache, and the plain indexer rows moved to their indexer slots.
        res[(transport, "mla")] = torch.equal(plain_mla[0].view(torch.uint8), own_mla[0].view(torch.uint8))
        want = torch.full_like(buf, GUARD)
        want_idx = want[:, :vp.BS * 132].view(ib, vp.BS, 132)
        for slot, islot in pairs:
            d, sc = indexer_row(want_idx, islot)
            rd, rsc = indexer_row(plain_idx[0], slot)
            d.copy_(rd)
            sc.copy_(rsc)
        res[(transport, "indexer")] = torch.equal(buf, want)
        # plain bytes: tensors would cross the result queue by file descriptors that die with this process
        res[(transport, "bytes")] = (own_mla[0].view(torch.uint8).numpy().tobytes(), buf.numpy().tobytes())
        for p in pubs:
            p.close()
        dist.barrier()
    return res


def test_publisher_puts_the_indexer_rows_at_their_own_slots_on_every_transport():
    transports = ("collect", "direct", "staging")
    out = run_ranks(_publisher_run, 2, "fp8_ds_mla", transports, timeout=300)
    for r in range(2):
        kind, val = out[r]
        assert kind == "ok", val
        for t in transports:
            assert val[(t, "mla")] is True, (r, t, "MLA cache differs from the one-slot publication's")
            assert val[(t, "indexer")] is True, (r, t, "indexer rows not at their own slots")
    # Every replica the same bytes, and staging's the same as direct's.
    for t in transports:
        for k in (0, 1):
            assert out[0][1][(t, "bytes")][k] == out[1][1][(t, "bytes")][k], (t, k)
    for k in (0, 1):
        assert out[0][1][("direct", "bytes")][k] == out[0][1][("staging", "bytes")][k], k
