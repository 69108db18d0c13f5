"""Layout helpers and pointer tables: cache views and dequantization on hand-made bytes, staging/peer tables
from tensors and from symmetric-memory handles (duck-typed: PyTorch's ``buffer_ptrs``, pcpkv's ``ptrs``)."""

import re

import pytest

from helpers import pk, torch


def test_dequantize_known_bytes():
    cache = pk.allocate_mla_cache(2, 4, "fp8_ds_mla", row_pad=8, block_pad=16, fill=0)
    v = pk.mla_cache_view(cache, "fp8_ds_mla")
    v["kv_c"][1, 2, :] = torch.full((512,), 1.5).to(torch.float8_e4m3fn)
    v["tile_scales"][1, 2, :] = torch.tensor([0.5, 2.0, 4.0, 0.25])
    v["k_pe"][1, 2, :] = torch.arange(64, dtype=torch.bfloat16)
    kv_c, k_pe = pk.dequantize_mla(cache, "fp8_ds_mla", slots=[6])
    assert kv_c[0, :128].eq(0.75).all() and kv_c[0, 128:256].eq(3.0).all() and kv_c[0, 384:].eq(0.375).all()
    assert torch.equal(k_pe[0], torch.arange(64, dtype=torch.float32))
    ic = pk.allocate_indexer_cache(2, 4, block_pad=12, fill=0)
    data, scales = pk.indexer_cache_view(ic)
    data[1, 3] = torch.full((128,), -2.0).to(torch.float8_e4m3fn)
    scales[1, 3] = 2.0 ** -5
    # SPEC section 3: block b's scale of row o lies at b*stride + B*128 + o*4
    raw = torch.as_strided(ic, (ic.untyped_storage().nbytes(),), (1,), 0)
    stride = 4 * 132 + 12
    assert raw[stride + 4 * 128 + 3 * 4: stride + 4 * 128 + 4 * 4].view(torch.float32).item() == 2.0 ** -5
    assert pk.dequantize_indexer(ic, slots=[7]).eq(-2.0 ** -4).all()
    with pytest.raises(ValueError, match="kv_format"):
        pk.allocate_mla_cache(1, 4, "int8")
    with pytest.raises(ValueError, match="power of two"):
        pk.allocate_indexer_cache(1, 6)
    # silently taken before: block_size=True (one-slot blocks), fill=-1 (255) and 1.5 (1), a float slot (1.7 read as
    # slot 1), an fp8 k_scale of nan (every value nan); num_blocks=-1 and a negative pcp_world raised torch's errors
    for call, match in ((lambda: pk.allocate_mla_cache(2, True, "fp8"), "block_size = True must be an integer"),
                        (lambda: pk.allocate_mla_cache(-1, 4, "fp8"), "num_blocks = -1 must be an integer >= 0"),
                        (lambda: pk.allocate_mla_cache(2, 4, "fp8", fill=-1), r"fill = -1 must be a byte value"),
                        (lambda: pk.allocate_indexer_cache(2, 4, fill=1.5), r"fill = 1.5 must be a byte value"),
                        (lambda: pk.allocate_staging(-1, 4, pk.CacheFormat()), "pcp_world = -1 must be an integer"),
                        (lambda: pk.dequantize_mla(cache, "fp8_ds_mla", slots=[6.7]), "slots: expected integer"),
                        (lambda: pk.dequantize_mla(pk.allocate_mla_cache(1, 4, "fp8", fill=0x38), "fp8",
                                                   k_scale=float("nan")), "dequantize_mla: k_scale = nan must be")):
        with pytest.raises(ValueError, match=match):
            call()
    assert pk.dequantize_mla(cache, "fp8_ds_mla", slots=[])[0].shape == (0, 512)


def test_plan_tensors():
    plan = pk.make_plan(4, [pk.Request(8, 0), pk.Request(1, 3, decode=True)], block_size=4, seed=1)
    M = plan.max_local_tokens
    assert torch.equal(plan.gathered_slot_mapping, plan.slot_mapping.reshape(-1))
    # DualChunkSwap, P=4, L=8: chunk 1; rank r owns tokens r and 7-r (positions stay global)
    for r in range(4):
        pos = plan.positions[r][plan.global_index[r] >= 0].tolist()
        assert pos[:2] == [r, 7 - r]
    # the decode is replicated; only rank 0's copy writes
    assert int((plan.slot_mapping >= 0).sum()) == 9 and plan.num_decode_tokens.tolist() == [1, 1, 1, 1]
    assert plan.block_tables.shape[0] == 2 and M == 3


class FakeTorchSymmMem:
    def __init__(self, ptrs):
        self.buffer_ptrs = ptrs


def test_peer_pointers_and_tables():
    bufs = [torch.zeros(4096, dtype=torch.uint8) for _ in range(3)]
    ptrs = pk.peer_pointers(FakeTorchSymmMem([b.data_ptr() for b in bufs]), offset_bytes=256)
    assert ptrs == [b.data_ptr() + 256 for b in bufs]
    assert pk.peer_pointers([1, 2]) == [1, 2]
    t = pk.pointer_table([2 ** 64 - 8, 16])  # uint64 bit patterns survive as int64
    assert t.tolist() == [-8, 16]
    fmt = pk.CacheFormat("fp8", k_scale=0.5, has_indexer=False)
    mla = [pk.allocate_mla_cache(3, 4, "fp8", fill=0) for _ in range(3)]
    targets = pk.CacheTargets.from_pointers([m.data_ptr() for m in mla], None, like_mla=mla[0], like_index=None,
                                            fmt=fmt, tensors=mla)
    assert len(targets) == 3 and targets.host.shape[1] == 72
    with pytest.raises(ValueError, match="null"):
        pk.CacheTargets.from_pointers([0], None, like_mla=mla[0], like_index=None, fmt=fmt)


def test_model_spec_from_hf_config_dicts():
    glm = pk.ModelSpec.from_hf_config({"model_type": "glm_moe_dsa", "q_lora_rank": 2048, "rms_norm_eps": 1e-5,
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 8e6},
                                        "index_topk_freq": 4, "index_skip_topk_offset": 3, "num_hidden_layers": 78})
    assert glm.indexer_rope_interleave and glm.rope == pk.RopeSpec("default", 8e6)
    assert sum(glm.layer_has_indexer(i) for i in range(78)) == 21  # the public GLM-5.2 count
    ds = pk.ModelSpec.from_hf_config({"model_type": "deepseek_v32", "q_lora_rank": 1536,
                                       "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32,
                                                        "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1,
                                                        "original_max_position_embeddings": 4096},
                                       "rope_theta": 10000})
    assert not ds.indexer_rope_interleave and ds.rope.scaling == "deepseek_yarn" and ds.rope.factor == 40
    with pytest.raises(ValueError, match="kv_lora_rank"):
        pk.ModelSpec.from_hf_config({"q_lora_rank": 8, "kv_lora_rank": 256})


def test_from_caches_checks_every_replica():
    """Issue 12: an indexer replica smaller than the first was accepted (only the MLA replicas were compared)
    and dispatch wrote past its end. Every replica must have the first one's dtype, shape, strides, device."""
    fmt = pk.CacheFormat("fp8_ds_mla")
    mla = [pk.allocate_mla_cache(4, 16, fmt.kv_format, row_pad=16, fill=0) for _ in range(3)]
    idx = [pk.allocate_indexer_cache(4, 16, block_pad=16, fill=0) for _ in range(3)]
    assert len(pk.CacheTargets.from_caches(mla, idx, fmt)) == 3
    # the overrun of the issue: a smaller indexer replica inside a guarded buffer
    guarded = torch.full((8 * 16 * 132,), 0xA5, dtype=torch.uint8)
    small_idx = guarded[:2 * 16 * 132].view(2, 16, 132)
    with pytest.raises(ValueError, match=r"index_caches\[2\]"):
        pk.CacheTargets.from_caches(mla, idx[:2] + [small_idx], fmt)
    assert bool((guarded == 0xA5).all())
    bad = {
        r"index_caches\[1\]": (mla, [idx[0], pk.allocate_indexer_cache(4, 16, block_pad=32), idx[2]]),  # other block stride
        r"index_caches\[1\].*uint8": (mla, [idx[0], idx[1].view(torch.int8), idx[2]]),
        r"mla_caches\[2\]": (mla[:2] + [pk.allocate_mla_cache(3, 16, fmt.kv_format, row_pad=16)], idx),
        r"mla_caches\[1\]": ([mla[0], pk.allocate_mla_cache(4, 16, "fp8"), mla[2]], idx),  # other row bytes
        r"mla_caches\[0\]": ([mla[0].transpose(0, 1)] + mla[1:], idx),
        "one index cache per MLA cache": (mla, idx[:2]),
        "index caches|one index cache": (mla, None),
    }
    for match, (m, i) in bad.items():
        with pytest.raises(ValueError, match=match):
            pk.CacheTargets.from_caches(m, i, fmt)
    with pytest.raises(ValueError, match="mla_caches"):
        pk.CacheTargets.from_caches([], idx, fmt)  # was IndexError
    with pytest.raises(ValueError, match="mla_caches"):
        pk.CacheTargets.from_caches(mla[0], idx, fmt)  # a tensor, not a list of them
    with pytest.raises(ValueError, match=r"index_caches\[0\]"):
        pk.CacheTargets.from_caches(mla, [mla[0]] * 3, fmt)  # the MLA cache passed as the indexer's
    # caches sharing memory (each passes the geometry checks): the same replica twice, an indexer cache inside an
    # MLA replica's bytes (with idx[0]'s strides), were accepted
    with pytest.raises(ValueError, match=r"mla_caches\[0\] \(.*\) shares memory with mla_caches\[1\]"):
        pk.CacheTargets.from_caches([mla[0], mla[0], mla[2]], idx, fmt)
    inside = torch.as_strided(mla[1], idx[0].shape, idx[0].stride(), mla[1].storage_offset())
    with pytest.raises(ValueError, match=r"mla_caches\[1\] \(.*\) shares memory with index_caches\[1\]"):
        pk.CacheTargets.from_caches(mla, [idx[0], inside, idx[2]], fmt)
    # a layer without an indexer ignores index_caches
    assert len(pk.CacheTargets.from_caches(mla, None, pk.CacheFormat("fp8_ds_mla", has_indexer=False))) == 3


def test_from_pointers_row_dests_and_fence_state_check_what_they_record():
    fmt = pk.CacheFormat("fp8", has_indexer=False)
    mla = pk.allocate_mla_cache(3, 4, "fp8", fill=0)
    ok = dict(like_mla=mla, like_index=None, fmt=fmt)
    assert len(pk.CacheTargets.from_pointers([mla.data_ptr()], None, **ok)) == 1
    with pytest.raises(ValueError, match="mla_ptrs is empty"):
        pk.CacheTargets.from_pointers([], None, **ok)
    with pytest.raises(ValueError, match=r"mla_ptrs\[1\]"):
        pk.CacheTargets.from_pointers([mla.data_ptr(), 0], None, **ok)
    with pytest.raises(ValueError, match="like_mla"):
        pk.CacheTargets.from_pointers([mla.data_ptr()], None, like_mla=mla.view(torch.int8), like_index=None, fmt=fmt)
    with pytest.raises(ValueError, match="like_mla"):  # float strides are not byte strides
        pk.CacheTargets.from_pointers([mla.data_ptr()], None, like_mla=torch.zeros(3, 4, 576), like_index=None, fmt=fmt)
    with pytest.raises(ValueError, match="device"):  # a CUDA table over host addresses
        pk.CacheTargets.from_pointers([mla.data_ptr()], None, **ok, device="cuda")
    ifmt = pk.CacheFormat("fp8")
    idx = pk.allocate_indexer_cache(3, 4, fill=0)
    with pytest.raises(ValueError, match="2 mla_ptrs but 1 index_ptrs"):
        pk.CacheTargets.from_pointers([mla.data_ptr()] * 2, [idx.data_ptr()], like_mla=mla, like_index=idx, fmt=ifmt)
    with pytest.raises(ValueError, match="like_index"):
        pk.CacheTargets.from_pointers([mla.data_ptr()], [idx.data_ptr()], like_mla=mla, like_index=mla, fmt=ifmt)
    # the op refuses an empty table too
    with pytest.raises(ValueError, match="mla_ptrs is empty"):
        torch.ops.pcpkv.make_cache_targets(pk.pointer_table([]), pk.pointer_table([]), 3, 4, 576, 2304, 0, "fp8", False)

    staging = [pk.allocate_staging(2, 5, fmt, fill=0) for _ in range(2)]
    assert len(pk.RowDests.from_staging(staging, 1)) == 2
    with pytest.raises(ValueError, match="staging"):
        pk.RowDests.from_staging([], 0)  # was IndexError
    with pytest.raises(ValueError, match=r"staging\[1\]"):
        pk.RowDests.from_staging([staging[0], staging[1][:, :, :, :4]], 0)  # a smaller workspace
    with pytest.raises(ValueError, match=r"staging\[0\]"):
        pk.RowDests.from_staging([staging[0].view(torch.int8)], 0)
    with pytest.raises(ValueError, match="src_rank"):
        pk.RowDests.from_staging(staging, 2)
    with pytest.raises(ValueError, match="ptrs is empty"):
        pk.RowDests.from_pointers([], "cpu")
    with pytest.raises(ValueError, match=r"ptrs\[0\]"):
        pk.RowDests.from_pointers([0], "cpu")
    with pytest.raises(ValueError, match="row_bytes"):
        pk.RowDests.from_pointers([staging[0].data_ptr()], "cpu", row_bytes=0)

    # the ranges of one pointer table: a range past the top of the address space still covers its end
    assert torch.ops.pcpkv.first_range_overlap(pk.pointer_table([2 ** 64 - 8, 2 ** 64 - 4]), [100, 1]) == [0, 1]
    with pytest.raises(ValueError, match="2 pointers but 1 sizes"):
        torch.ops.pcpkv.first_range_overlap(pk.pointer_table([8, 16]), [8])
    with pytest.raises(ValueError, match=r"sizes\[1\] = -1"):
        torch.ops.pcpkv.first_range_overlap(pk.pointer_table([8, 16]), [8, -1])

    pads = pk.allocate_fence_pads(2, num_barriers=2)
    assert pk.FenceState.local(pads, num_barriers=2).world == 2
    with pytest.raises(ValueError, match="pads"):
        pk.FenceState.local([])  # was IndexError
    with pytest.raises(ValueError, match=r"pads\[1\]"):  # a pad too small for num_barriers = 2
        pk.FenceState.local([pads[0], pk.allocate_fence_pads(2, num_barriers=1)[0]], num_barriers=2)
    with pytest.raises(ValueError, match=r"pads\[0\]"):
        pk.FenceState.local([p.int() for p in pads], num_barriers=2)
    ptrs = [p.data_ptr() for p in pads]
    with pytest.raises(ValueError, match="world = 0"):
        pk.FenceState([], world=0)
    with pytest.raises(ValueError, match="num_barriers = 0"):
        pk.FenceState(ptrs, world=2, num_barriers=0)
    with pytest.raises(ValueError, match=r"ranks \[1, 3\)"):
        pk.FenceState(ptrs, world=2, first_rank=1, num_local_ranks=2)
    with pytest.raises(ValueError, match=r"pad_ptrs\[1\] = .* not 8-byte aligned"):
        pk.FenceState([ptrs[0], ptrs[1] + 4], world=2)
    with pytest.raises(ValueError, match=r"pad_ptrs\[0\]"):
        pk.FenceState([0, ptrs[1]], world=2)
    # Pads sharing memory (one pad twice, a pad 8 bytes into another) were accepted: a rank's signal then landed in
    # another rank's slots. Refused naming both; pads that only touch (one buffer split in two) are accepted.
    for shared in ([ptrs[0], ptrs[0]], [ptrs[0], ptrs[0] + 8]):
        with pytest.raises(ValueError, match=r"FenceState: pad_ptrs\[0\] = .* \(64 B\) overlaps pad_ptrs\[1\] = "):
            pk.FenceState(shared, world=2, num_barriers=2)
    with pytest.raises(ValueError, match=r"FenceState: pad_ptrs\[0\] = .* overlaps pad_ptrs\[1\] = "):
        pk.FenceState.local([pads[0], pads[0]], num_barriers=2)
    one = torch.zeros((2, 2, 2, 2), dtype=torch.int64)
    assert pk.FenceState.local([one[0], one[1]], num_barriers=2).world == 2


def test_pointer_tables_refuse_overlapping_entries():
    """CacheTargets.from_pointers / RowDests.from_pointers accepted entries whose bytes overlap (an address twice, an
    address inside another replica): a dispatch writes every entry, so one would overwrite another's rows. Refused
    naming both entries; entries that touch without overlapping are accepted."""
    fmt = pk.CacheFormat("fp8_ds_mla")
    like_mla = pk.allocate_mla_cache(3, 16, fmt.kv_format, row_pad=16, block_pad=64)
    like_idx = pk.allocate_indexer_cache(3, 16, block_pad=32)
    # the bytes a dispatch writes through one record: up to the last slot's end (not the last block's padding)
    mla_bytes = 2 * like_mla.stride(0) + 15 * like_mla.stride(1) + 656
    idx_bytes = 2 * like_idx.stride(0) + 16 * 132
    buf = (torch.arange(2 * mla_bytes + 2 * idx_bytes) % 251 + 1).to(torch.uint8)  # poisoned, must stay so
    before = buf.clone()
    m0, i0 = buf.data_ptr(), buf.data_ptr() + 2 * mla_bytes

    def targets(mla_ptrs, idx_ptrs):
        return pk.CacheTargets.from_pointers(mla_ptrs, idx_ptrs, like_mla=like_mla, like_index=like_idx, fmt=fmt)

    refused = [
        ("mla_ptrs[0]", "mla_ptrs[1]", [m0, m0], [i0, i0 + idx_bytes]),                    # the same replica twice
        ("mla_ptrs[0]", "mla_ptrs[1]", [m0, m0 + mla_bytes // 2], [i0, i0 + idx_bytes]),  # half a cache in
        ("mla_ptrs[0]", "mla_ptrs[1]", [m0, m0 + mla_bytes - 1], [i0, i0 + idx_bytes]),   # one byte in common
        ("index_ptrs[0]", "index_ptrs[1]", [m0, m0 + mla_bytes], [i0, i0 + idx_bytes - 4]),
        ("mla_ptrs[1]", "index_ptrs[0]", [m0, m0 + mla_bytes], [m0 + 2 * mla_bytes - 132, i0 + idx_bytes]),
    ]
    for a, b, mp, ip in refused:
        with pytest.raises(ValueError, match=rf"CacheTargets: {re.escape(a)} = .* overlaps {re.escape(b)} = "):
            targets(mp, ip)
    # end to end in one buffer: accepted
    assert len(targets([m0, m0 + mla_bytes], [i0, i0 + idx_bytes])) == 2
    # no indexer: index pointers are not recorded, so they cannot collide
    no_idx = pk.CacheFormat("fp8_ds_mla", has_indexer=False)
    assert len(pk.CacheTargets.from_pointers([m0, m0 + mla_bytes], None, like_mla=like_mla, like_index=None,
                                             fmt=no_idx)) == 2

    staging = pk.allocate_staging(2, 5, fmt, fill=0)
    slot = 5 * fmt.row_bytes  # max_rows * row_bytes: a staging slot
    p = staging.data_ptr()
    with pytest.raises(ValueError, match=r"RowDests: ptrs\[0\] = .* overlaps ptrs\[1\] = "):
        pk.RowDests.from_staging([staging, staging], 0)  # one workspace listed twice
    with pytest.raises(ValueError, match=r"RowDests: ptrs\[1\] = .* overlaps ptrs\[2\] = "):
        pk.RowDests.from_pointers([p, p + slot, p + 2 * slot - fmt.row_bytes], "cpu", row_bytes=fmt.row_bytes,
                                  max_rows=5)
    with pytest.raises(ValueError, match=r"RowDests: ptrs\[0\] = .* overlaps ptrs\[1\] = "):
        pk.RowDests.from_pointers([p, p], "cpu")  # without the slot size: a repeated address still collides
    assert len(pk.RowDests.from_pointers([p, p + slot, p + 2 * slot], "cpu", row_bytes=fmt.row_bytes, max_rows=5)) == 3
    assert len(pk.RowDests.from_pointers([p, p + 1], "cpu")) == 2  # unknown sizes: only one byte is known
    # a table constructor writes nothing; checked as for every refused call
    assert torch.equal(buf, before) and int(staging.count_nonzero()) == 0
