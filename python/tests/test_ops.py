"""The ops on every available device: both transports give byte-identical replicas, guard bytes stay, the
fence reports a missing rank, and the CUDA kernels (pcpkv's launchers, every dispatch kernel variant, aligned
and unaligned inputs) equal the CPU reference byte for byte. Argument errors: test_errors.py."""

import pytest

from helpers import DEVICES, GUARD, World, assert_bytes_equal, llm_like, pk, poisoned_bf16, requires_cuda, torch

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
    outs = dict(kv_c_out=poisoned_bf16(M, 512, w.device), k_pe_out=poisoned_bf16(M, 64, w.device),
                index_k_out=poisoned_bf16(M, 128, w.device))
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


def compare_worlds(worlds, plan, what):
    """CUDA world vs CPU world: replicas (guard bytes included), q_c_out and topk of every rank."""
    torch.cuda.synchronize()
    for r in range(plan.pcp_world):
        for x, y, part in zip(worlds["cuda"].replica_bytes(r), worlds["cpu"].replica_bytes(r), ("mla", "index")):
            assert_bytes_equal(x, y, f"{what} rank {r} {part}: cuda vs cpu")
        for k in ("q_c_out", "topk"):
            assert torch.equal(worlds["cuda"].local[r][k].cpu(), worlds["cpu"].local[r][k]), f"{what}: {k} rank {r}"


def publish_both(worlds, plan, what):
    for transport in ("staging", "direct"):
        for w in worlds.values():
            w.poison()
            w.publish(transport)
        compare_worlds(worlds, plan, f"{what} {transport}")
        if transport == "staging":
            for r in range(plan.pcp_world):
                # transport rows of real tokens (padding rows are unspecified)
                for s in range(plan.pcp_world):
                    real = plan.global_index[s] >= 0
                    assert torch.equal(worlds["cuda"].staging[r][0, 0, s][real.cuda()].cpu(),
                                       worlds["cpu"].staging[r][0, 0, s][real]), f"{what}: staging rows {s} -> {r}"


@requires_cuda
@pytest.mark.parametrize("variant", ["prefetch", "simple", "warp", "warp_pf", "warp_token", "warp_split"])
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("index_rope_interleaved", [False, True])
def test_cuda_equals_cpu_reference(monkeypatch, variant, kv_format, index_rope_interleaved):
    # launch_dispatch reads PCPKV_DISPATCH_VARIANT at every launch (src/publish/kernels/cuda/dispatch.cu
    # resolve_variant; an unknown name is refused: src/publish/contract/dispatch_variant.cpp)
    monkeypatch.setenv("PCPKV_DISPATCH_VARIANT", variant)
    plan = small_plan(4, seed=5)
    fmt = pk.CacheFormat(kv_format, k_scale=0.5 if kv_format == "fp8" else 1.0)
    worlds = {d: World(plan, fmt, d, seed=6, index_rope_interleaved=index_rope_interleaved) for d in ("cpu", "cuda")}
    publish_both(worlds, plan, f"{variant} {kv_format}")


@requires_cuda
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("has_indexer", [True, False])
def test_cuda_unaligned_inputs_equal_cpu_reference(kv_format, has_indexer):
    """Inputs as views of one wider projection at an offset of 2 elements (4-byte aligned rows): the launcher
    picks the generic-alignment kernel instances; bytes still equal the CPU reference's."""
    plan = small_plan(2, seed=7)
    fmt = pk.CacheFormat(kv_format, k_scale=0.25 if kv_format == "fp8" else 1.0, has_indexer=has_indexer)
    worlds = {d: World(plan, fmt, d, seed=8) for d in ("cpu", "cuda")}
    for w in worlds.values():
        for loc in w.local:
            cols = [("q_c", loc["q_c"].shape[1]), ("kv", 512), ("k_pe", 64), ("index_k", 128)]
            wide = torch.zeros(w.M, 2 + sum(c for _, c in cols), dtype=torch.bfloat16, device=w.device)
            at = 2
            for k, c in cols:
                wide[:, at:at + c] = loc[k]
                loc[k] = wide[:, at:at + c]
                at += c
    publish_both(worlds, plan, f"unaligned {kv_format} indexer={has_indexer}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("has_indexer", [True, False])
def test_insert_matches_between_devices_and_decodes(device, kv_format, has_indexer):
    """Collect path: the device's bytes equal the CPU reference's (guard bytes included); decoded rows are the
    bf16 inputs (bf16 exactly; fp8 / fp8_ds_mla within E4M3's relative half-ulp 2^-4 plus a subnormal step)."""
    plan = small_plan(1)
    k_scale = 2.0 if kv_format == "fp8" else 1.0  # keeps the outlier channels below E4M3's 448 (no saturation)
    fmt = pk.CacheFormat(kv_format, k_scale=k_scale, has_indexer=has_indexer)
    gen = torch.Generator().manual_seed(9)
    n = plan.global_slots.numel()
    kv_c, k_pe, idx_k = llm_like(gen, n, 512), llm_like(gen, n, 64), llm_like(gen, n, 128)
    out = {}
    for d in ["cpu", device]:
        mla = pk.allocate_mla_cache(plan.num_blocks, plan.block_size, fmt.kv_format, d, fill=GUARD, row_pad=16)
        ic = pk.allocate_indexer_cache(plan.num_blocks, plan.block_size, d, fill=GUARD)
        pk.insert(kv_c.to(d), k_pe.to(d), idx_k.to(d) if has_indexer else None, plan.global_slots.to(d), mla,
                  ic if has_indexer else None, fmt=fmt)
        out[d] = (mla.cpu(), ic.cpu())
    assert_bytes_equal(out[device][0], out["cpu"][0], f"insert {kv_format}: MLA cache {device} vs cpu")
    assert_bytes_equal(out[device][1], out["cpu"][1], f"insert {kv_format}: indexer cache {device} vs cpu")
    if not has_indexer:
        assert bool((out["cpu"][1] == GUARD).all()), "a layer without an indexer wrote indexer bytes"
    got_kv, got_pe = pk.dequantize_mla(out["cpu"][0], kv_format, k_scale=k_scale, slots=plan.global_slots)
    want_kv, want_pe = kv_c.float(), k_pe.float()
    if kv_format == "bf16":
        assert torch.equal(got_kv, want_kv) and torch.equal(got_pe, want_pe)
        return
    if kv_format == "fp8_ds_mla":
        assert torch.equal(got_pe, want_pe), "fp8_ds_mla keeps k_pe in bf16"
        tile_amax = want_kv.abs().view(n, 4, 128).amax(dim=2, keepdim=True).expand(n, 4, 128).reshape(n, 512)
        step = tile_amax / 448 * 2.0 ** -9 * 2  # a tile's scale (<= 2 amax / 448, pow2) times E4M3's subnormal step
        over = int(((got_kv - want_kv).abs() > 2.0 ** -4 * want_kv.abs() + step).sum())
        assert over == 0, f"fp8_ds_mla kv_c: {over} values outside the E4M3 bound"
    else:
        for got, want, name in ((got_kv, want_kv, "kv_c"), (got_pe, want_pe, "k_pe")):
            # x / k_scale in E4M3, decoded * k_scale: half-ulp 2^-4 relative, subnormal step 2^-9 * k_scale
            over = int(((got - want).abs() > 2.0 ** -4 * want.abs() + 2.0 ** -10 * k_scale).sum())
            assert over == 0, f"fp8 {name}: {over} values outside the E4M3 bound"
