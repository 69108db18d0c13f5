"""The ops on every available device: both transports give byte-identical replicas, guard bytes stay,
errors name the argument, the fence reports a missing rank, and the CUDA kernels equal the CPU reference
byte for byte."""

import pytest

from helpers import DEVICES, GUARD, World, assert_bytes_equal, pk, requires_cuda, torch

FORMATS = ["fp8_ds_mla", "fp8", "bf16"]


def small_plan(world, seed=0):
    reqs = [pk.Request(37, 0), pk.Request(50, 11), pk.Request(1, 20, decode=True), pk.Request(1, 5, decode=True)]
    return pk.make_plan(world, reqs, block_size=16, extra_blocks=2, seed=seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("has_indexer", [True, False])
def test_staging_equals_direct_and_replicas_identical(device, kv_format, has_indexer):
    plan = small_plan(4)
    fmt = pk.CacheFormat(kv_format, k_scale=0.37 if kv_format == "fp8" else 1.0, has_indexer=has_indexer)
    a = World(plan, fmt, device, seed=1)
    b = World(plan, fmt, device, seed=1)
    a.publish("direct")
    b.publish("staging")
    ref = a.replica_bytes(0)
    for r in range(plan.pcp_world):
        for x, y, what in zip(a.replica_bytes(r), ref, ("mla", "index")):
            assert_bytes_equal(x, y, f"direct replica {r} vs replica 0 ({what})")
        for x, y, what in zip(b.replica_bytes(r), ref, ("mla", "index")):
            assert_bytes_equal(x, y, f"staging replica {r} vs direct replica 0 ({what})")
    # Every written slot changed its row; nothing else did (the untouched bytes keep the guard value).
    mla_flat = a.flat(a.mla[0]).cpu()
    written = plan.global_slots[plan.global_slots >= 0]
    num_rows_bytes = written.numel() * fmt.mla_row_bytes
    assert int((mla_flat != GUARD).sum()) <= num_rows_bytes
    assert int((mla_flat != GUARD).sum()) > num_rows_bytes * 0.9
    if not has_indexer:
        assert bool((a.flat(a.idx[0]).cpu() == GUARD).all()), "a layer without an indexer wrote indexer bytes"
    topk = a.local[0]["topk"].cpu()
    assert bool((topk == -1).all()) == has_indexer


@pytest.mark.parametrize("device", DEVICES)
def test_cache_rows_decode_to_the_normalized_values(device):
    """Dequantized cache rows agree with the materialized bf16 kv_c / k_pe / index_k within the FP8 bound."""
    plan = small_plan(2)
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = World(plan, fmt, device, seed=2)
    r = 0
    loc = w.local[r]
    M = w.M
    outs = dict(kv_c_out=torch.empty(M, 512, dtype=torch.bfloat16, device=w.device),
                k_pe_out=torch.empty(M, 64, dtype=torch.bfloat16, device=w.device),
                index_k_out=torch.empty(M, 128, dtype=torch.bfloat16, device=w.device))
    w.dispatch(r, targets=w.targets, **outs)
    slots = loc["slot_mapping"]
    keep = slots >= 0
    kv_c, k_pe = pk.dequantize_mla(w.mla[r], "fp8_ds_mla", slots=slots[keep])
    idx = pk.dequantize_indexer(w.idx[r], slots=slots[keep])
    for got, want, name in ((kv_c, outs["kv_c_out"][keep].float(), "kv_c"),
                            (idx, outs["index_k_out"][keep].float(), "index_k")):
        # bf16 materialization and E4M3 both round the same fp32 value: 2^-4 rel + 2^-9 rel + subnormal step.
        s = want.abs().amax(dim=1, keepdim=True)
        bound = 2.0 ** -4 * want.abs() + 2.0 ** -8 * want.abs() + 2.0 ** -9 * s / 448 * 2
        over = ((got - want).abs() > bound).sum().item()
        assert over == 0, f"{name}: {over} values outside the FP8 bound"
    assert torch.equal(k_pe, outs["k_pe_out"][keep].float()), "fp8_ds_mla keeps k_pe in bf16"


def test_errors_name_the_argument():
    plan = small_plan(2)
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = World(plan, fmt, "cpu", seed=3)
    loc = w.local[0]
    with pytest.raises(ValueError, match="kv: expected bfloat16"):
        pk.dispatch(loc["kv"].float(), loc["k_pe"], loc["positions"], w.weights["kv_norm_w"], w.rope_cos_sin,
                    fmt=pk.CacheFormat("fp8_ds_mla", has_indexer=False))
    bad = loc["slot_mapping"].clone()
    bad[3] = plan.num_slots + 5
    with pytest.raises(ValueError, match=r"slot_mapping\[3\]"):
        pk.dispatch(loc["kv"], loc["k_pe"], loc["positions"], w.weights["kv_norm_w"], w.rope_cos_sin, fmt=fmt,
                    index_k=loc["index_k"], index_ln_w=w.weights["index_ln_w"], index_ln_b=w.weights["index_ln_b"],
                    slot_mapping=bad, targets=w.targets)
    assert bool((w.flat(w.mla[0]) == GUARD).all()), "a rejected call wrote bytes"
    with pytest.raises(ValueError, match="kv_format"):
        pk.CacheFormat("fp4")
    with pytest.raises(ValueError, match="block-size|block_size"):
        pk.make_plan(2, [pk.Request(5)], block_size=12)
    with pytest.raises(ValueError, match="out of range"):
        pk.validate_slots(bad, plan.num_slots)


@pytest.mark.parametrize("device", DEVICES)
def test_fence_reports_the_missing_rank(device):
    pads = pk.allocate_fence_pads(3, device=device)
    # This process hosts ranks 0 and 1 only; rank 2 never arrives.
    state = pk.FenceState([p.data_ptr() for p in pads], world=3, num_barriers=1, first_rank=0, num_local_ranks=2,
                          device=device, pads=pads)
    if device == "cpu":
        with pytest.raises(RuntimeError, match="rank 2 never arrived"):
            pk.fence(state, 0, timeout_us=20_000)
    else:
        pk.fence(state, 0, timeout_us=20_000)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="rank 2 never arrived"):
            state.check()
    info = state.error_info()
    assert info["missing_rank"] == 2 and info["epoch"] == 1


@requires_cuda
@pytest.mark.parametrize("impl", ["pcpkv", "reference"])
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("index_rope_interleaved", [False, True])
def test_cuda_equals_cpu_reference(monkeypatch, impl, kv_format, index_rope_interleaved):
    if impl == "pcpkv" and pk.cuda_dispatch_impl() != "pcpkv":
        pytest.skip("built without pcpkv's fused dispatch kernel (src/cuda/dispatch.cu)")
    if impl == "reference":
        monkeypatch.setenv("PCPKV_TORCH_DISPATCH", "reference")
    plan = small_plan(4, seed=5)
    fmt = pk.CacheFormat(kv_format, k_scale=0.5 if kv_format == "fp8" else 1.0)
    worlds = {d: World(plan, fmt, d, seed=6, index_rope_interleaved=index_rope_interleaved) for d in ("cpu", "cuda")}
    for transport in ("staging", "direct"):
        for w in worlds.values():
            w.poison()
            w.publish(transport)
        torch.cuda.synchronize()
        for r in range(plan.pcp_world):
            for x, y, what in zip(worlds["cuda"].replica_bytes(r), worlds["cpu"].replica_bytes(r), ("mla", "index")):
                assert_bytes_equal(x, y, f"{impl} {transport} rank {r} {what}: cuda vs cpu")
            for k in ("q_c_out", "topk"):
                assert torch.equal(worlds["cuda"].local[r][k].cpu(), worlds["cpu"].local[r][k]), f"{k} rank {r}"
        if transport == "staging":
            for r in range(plan.pcp_world):
                # transport rows of real tokens (padding rows are unspecified)
                for s in range(plan.pcp_world):
                    real = plan.global_index[s] >= 0
                    assert torch.equal(worlds["cuda"].staging[r][0, 0, s][real.cuda()].cpu(),
                                       worlds["cpu"].staging[r][0, 0, s][real]), f"staging rows {s} -> {r}"


@pytest.mark.parametrize("device", DEVICES)
def test_insert_matches_between_devices_and_decodes(device):
    plan = small_plan(1)
    fmt = pk.CacheFormat("fp8_ds_mla")
    gen = torch.Generator().manual_seed(9)
    from helpers import llm_like
    n = plan.global_slots.numel()
    kv_c, k_pe, idx_k = llm_like(gen, n, 512), llm_like(gen, n, 64), llm_like(gen, n, 128)
    out = {}
    for d in ["cpu", device]:
        mla = pk.allocate_mla_cache(plan.num_blocks, plan.block_size, fmt.kv_format, d, fill=GUARD)
        ic = pk.allocate_indexer_cache(plan.num_blocks, plan.block_size, d, fill=GUARD)
        pk.insert(kv_c.to(d), k_pe.to(d), idx_k.to(d), plan.global_slots.to(d), mla, ic, fmt=fmt)
        out[d] = (mla.cpu(), ic.cpu())
    assert torch.equal(out["cpu"][0], out[device][0]) and torch.equal(out["cpu"][1], out[device][1])
    got_kv, got_pe = pk.dequantize_mla(out["cpu"][0], "fp8_ds_mla", slots=plan.global_slots)
    assert torch.equal(got_pe, k_pe.float())
    assert ((got_kv - kv_c.float()).abs() <= 2 ** -4 * kv_c.float().abs() + 1e-3).all()
