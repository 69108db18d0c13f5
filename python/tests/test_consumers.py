"""The consumer ops (pcpkv_torch.consumers) against independent torch computations on caches that pk.dispatch
wrote: the indexer's top-k exactly (scores recomputed in the documented fp32 rounding order, sets and order
compared, ties by position, -1 tails), sparse MLA within a stated bound of fp64, the LSE merge of key-set shards
against full attention, the bf16 reader view of fp8_ds_mla scales, CPU vs CUDA, errors, torch.compile."""

import math

import pytest

from helpers import DEVICES, POISON_I32, World, llm_like, pk, requires_cuda, torch

U = 2.0 ** -24  # fp32 unit roundoff
H_ATTN = 4      # attention heads of the small problems
SOFTMAX_SCALE = float(torch.tensor(192 ** -0.5, dtype=torch.float32))  # qk_head_dim^-0.5; the op takes fp32


def plan_of():
    # prefills from position 0 (every key a token of the plan wrote), lengths around and below topk
    return pk.make_plan(2, [pk.Request(45, 0), pk.Request(9, 0), pk.Request(33, 0)], block_size=16, extra_blocks=1,
                        seed=5)


def published(fmt, device, seed=0):
    """A world whose replicas hold every token of plan_of() (direct transport) and replica 0's caches."""
    w = World(plan_of(), fmt, device, seed=seed)
    w.publish("direct")
    return w


def index_inputs(w, num_heads, seed, *, pad=True):
    """Indexer inputs over the plan's global tokens (+ one padding token): q_fp8, q_scale (quantize_index_q of
    LLM-like bf16 queries), weights (signed, outliers), positions, request_idx, block_tables."""
    gen = torch.Generator().manual_seed(seed)
    plan = w.plan
    N = plan.global_positions.numel()
    T = N + int(pad)
    q = llm_like(gen, T * num_heads, 128).view(T, num_heads, 128)
    weights = llm_like(gen, T, num_heads).float()
    positions = torch.cat([plan.global_positions, torch.tensor([7] * int(pad))]).long()
    request_idx = torch.cat([plan.global_request, torch.tensor([-1] * int(pad))]).int()
    dev = w.device
    q_fp8, q_scale = pk.quantize_index_q(q.to(dev))
    return dict(q_fp8=q_fp8, q_scale=q_scale, weights=weights.to(dev), positions=positions.to(dev),
                request_idx=request_idx.to(dev), block_tables=plan.block_tables.to(dev), index_cache=w.idx[0])


def tree_logits(k, q):
    """kFp32Tree logits [n, H] of keys k [n, 128] and queries q [H, 128] (E4M3 values as float32): 16 leaves of 8
    dims summed from 0 in fp32 (products of two E4M3 values are exact, so s + q*k is the fma), then the
    pairwise tree over the leaves."""
    prod = k.float().unsqueeze(1) * q.float().unsqueeze(0)  # [n, H, 128], exact
    leaf = torch.zeros(prod.shape[:2] + (16,), dtype=torch.float32)
    for e in range(8):
        leaf = leaf + prod[..., e::8]
    while leaf.shape[-1] > 1:
        leaf = leaf[..., 0::2] + leaf[..., 1::2]
    return leaf[..., 0]


def reference_topk(inp, topk, block_size, logit="exact"):
    """Independent top-k: scores in pcpkv/device/consumers.h's order, in torch fp32 (each logit the exact fp64
    dot product rounded once, or the fp32 tree, w = (weights * c) * q_scale, terms relu(logit) * w summed over
    heads from +0 sequentially, times k_scale), then sorted by (score desc, position asc). Also the fp64 scores
    (dequantize_indexer keys) to check that the fp32 order is the contract's arithmetic, not a copy of it."""
    cpu = {k: v.cpu() for k, v in inp.items()}
    q = cpu["q_fp8"].view(torch.float8_e4m3fn).double()
    T, H, _ = q.shape
    data, scales = pk.indexer_cache_view(cpu["index_cache"])
    keys_fp8 = data.reshape(-1, 128).double()
    k_scale = scales.reshape(-1)
    keys = pk.dequantize_indexer(cpu["index_cache"]).double()
    c = torch.tensor(1.0 / math.sqrt(128.0 * H), dtype=torch.float64).float()
    w = (cpu["weights"] * c) * cpu["q_scale"]
    slots_out = torch.full((T, topk), -1, dtype=torch.int32)
    pos_out = torch.full((T, topk), -1, dtype=torch.int32)
    ties = 0  # tokens whose selection holds equal scores (their order is the position rule's)
    for t in range(T):
        req = int(cpu["request_idx"][t])
        if req < 0:
            continue
        n = int(cpu["positions"][t]) + 1
        j = torch.arange(n)
        slots = cpu["block_tables"][req][j // block_size].long() * block_size + j % block_size
        if logit == "exact":
            logits = (keys_fp8[slots] @ q[t].T).float()  # [n, H]: exact in fp64, rounded once
        else:
            logits = tree_logits(keys_fp8[slots], q[t])
        acc = torch.zeros(n, dtype=torch.float32)
        for h in range(H):
            acc = acc + torch.relu(logits[:, h]) * w[t, h]
        score = acc * k_scale[slots]
        exact = (torch.relu(keys[slots] @ q[t].T) * (w[t].double())).sum(1)
        bound = 4 * (H + 2) * U * (torch.relu(keys[slots] @ q[t].T) * w[t].double().abs()).sum(1) + 1e-30
        assert bool(((score.double() - exact).abs() <= bound).all()), "fp32 scores are not within rounding of fp64"
        order = sorted(range(n), key=lambda i: (-float(score[i]), i))[:topk]
        ties += int(torch.unique(score[order]).numel() < len(order))
        slots_out[t, :len(order)] = slots[order].int()
        pos_out[t, :len(order)] = torch.tensor(order, dtype=torch.int32)
    return slots_out, pos_out, ties


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,topk,logit", [(16, 24, "exact"), (2, 40, "exact"), (16, 24, "fp32_tree")])
def test_indexer_topk_exact(device, num_heads, topk, logit):
    w = published(pk.CacheFormat("fp8_ds_mla"), device, seed=1)
    inp = index_inputs(w, num_heads, seed=2)
    T = inp["q_fp8"].shape[0]
    out = torch.full((T, topk), POISON_I32, dtype=torch.int32, device=w.device)
    pos = torch.full((T, topk), POISON_I32, dtype=torch.int32, device=w.device)
    got = pk.indexer_topk(**inp, topk=topk, out=out, positions_out=pos, logit=logit)
    assert got is out
    ref_slots, ref_pos, ties = reference_topk(inp, topk, w.plan.block_size, logit)
    assert torch.equal(got.cpu(), ref_slots), "top-k slots differ from the reference"
    assert torch.equal(pos.cpu(), ref_pos), "top-k positions differ from the reference"
    n_keys = inp["positions"].cpu() + 1
    short = (n_keys < topk) & (inp["request_idx"].cpu() >= 0)
    assert bool(short.any()), "the test needs tokens with fewer keys than topk (the -1 tail)"
    assert bool((got.cpu()[-1] == -1).all()), "the padding token's row must be all -1"
    if num_heads == 2:
        # two heads: many keys score exactly 0 (both logits <= 0); those ties must go by position
        assert ties > 0, "the two-head case must select tied scores"


@pytest.mark.parametrize("device", DEVICES)
def test_indexer_topk_empty_and_default_max_keys(device):
    w = published(pk.CacheFormat("bf16"), device, seed=3)
    inp = index_inputs(w, 4, seed=4)
    a = pk.indexer_topk(**inp, topk=16)
    b = pk.indexer_topk(**inp, topk=16, max_keys=int(inp["positions"].max()) + 1)
    assert torch.equal(a, b)
    empty = {k: v[:0] if k not in ("block_tables", "index_cache") else v for k, v in inp.items()}
    assert pk.indexer_topk(**empty, topk=16).shape == (0, 16)


def quantize_ref(q):
    """SPEC section 3 index-query quantizer in plain torch (finite, non-pathological inputs)."""
    x = q.float()
    amax = x.abs().amax(-1).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax.double() / 448.0))).float()
    return (x / s.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8), s


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_index_q(device):
    gen = torch.Generator().manual_seed(9)
    q = llm_like(gen, 5 * 8, 128).view(5, 8, 128)
    q[0, 0] = 0  # all-zero head: scale 2^ceil(log2(1e-4 / 448))
    q_fp8, q_scale = pk.quantize_index_q(q.to(device))
    ref_fp8, ref_scale = quantize_ref(q)
    assert torch.equal(q_scale.cpu(), ref_scale)
    assert torch.equal(q_fp8.cpu(), ref_fp8)
    # the ATen form (the CUDA implementation) equals the C++ oracle bit for bit, pathological values included
    special = q.clone()
    special[1, 0, 3] = float("nan")
    special[1, 1, 5] = float("inf")
    special[1, 2, 7] = -float("inf")
    special[2, 0, :] = 1e-38  # subnormal quotients
    special[2, 1, 1] = 3e38
    special[3, 0, 0] = -float("nan")
    o_fp8, o_scale = pk.quantize_index_q(special)
    a_fp8, a_scale = torch.empty_like(o_fp8), torch.empty_like(o_scale)
    torch.ops.pcpkv.quantize_index_q_aten(special, a_fp8, a_scale)
    assert torch.equal(a_scale.view(torch.int32), o_scale.view(torch.int32))
    assert torch.equal(a_fp8, o_fp8)


# ---- sparse MLA ----------------------------------------------------------------------------------------

def attention_inputs(w, indices_src, seed):
    """q bf16 [T, H_ATTN, 576] and indices int32 [T, K]: the indexer's top-k with some duplicates, plus one row
    with no valid slot (-1 everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    idx = indices_src.clone().cpu()
    T, K = idx.shape
    idx[1, 1] = idx[1, 0]  # a duplicate counts twice
    idx[2, :] = -1         # no valid slot: out 0, lse -inf
    q = llm_like(gen, T * H_ATTN, 576).view(T, H_ATTN, 576)
    return q.to(w.device), idx.to(w.device)


def attention_ref(w, q, idx, fmt, *, bf16_scales=False):
    """fp64 attention over dequantize_mla's values (tile scales rounded to bf16 when bf16_scales): out, lse and
    per (t, h) sum_j p_j |v_j| (for bounds) and max_j softmax_scale * sum_i |q_i k_ji|."""
    cache = w.mla[0].cpu()
    kv_c, k_pe = pk.dequantize_mla(cache, fmt.kv_format, fmt.k_scale)
    if bf16_scales:
        v = pk.mla_cache_view(cache, "fp8_ds_mla")
        s = v["tile_scales"].reshape(-1, 4).bfloat16().double()
        kv_c = (v["kv_c"].reshape(-1, 4, 128).double() * s.unsqueeze(-1)).view(-1, 512)
    k = torch.cat([kv_c.double(), k_pe.double()], 1)  # [num_slots, 576]
    q, idx = q.cpu().double(), idx.cpu().long()
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    abs_pv = torch.zeros(T, H, 512, dtype=torch.float64)
    max_s = torch.zeros(T, H, dtype=torch.float64)
    keys = torch.zeros(T, dtype=torch.int64)
    for t in range(T):
        sel = idx[t][idx[t] >= 0]
        keys[t] = sel.numel()
        if sel.numel() == 0:
            continue
        kt = k[sel]
        s = SOFTMAX_SCALE * (q[t] @ kt.T)  # [H, K]
        p = torch.softmax(s, -1)
        out[t] = p @ kt[:, :512]
        lse[t] = torch.logsumexp(s, -1)
        abs_pv[t] = p @ kt[:, :512].abs()
        max_s[t] = (SOFTMAX_SCALE * (q[t].abs() @ kt.abs().T)).amax(-1)
    return out, lse, abs_pv, max_s, keys


def sparse_mla_bound(abs_pv, max_s, keys, ref, arith):
    """pcpkv::SparseMlaBound::out_bound (sparse_mla.h) per value; arith "fp32" (the CPU reference and the simt
    kernel) or "bf16_mma" (the mma kernel)."""
    mma = arith == "bf16_mma"  # "fp32_once" (the CPU reference) is within the fp32 bound too
    K = keys.double().view(-1, 1, 1)
    delta = ((4 * 576 + 16) if mma else (576 + 8)) * U * max_s.unsqueeze(-1)
    sigma = (2 if mma else 1) * (2 * K + 16 * torch.clamp(K, max=256) + 64) * U
    # bf16 round to nearest moves a value by up to 2^-8 relative (8 significant bits); sparse_mla.h states
    # 2^-9 for this term, which is half of that (reported to the lead).
    rho = 2.0 ** -8 + U if mma else 0.0
    return (2 * delta + sigma + rho) * abs_pv + 2 * U * ref.abs() + 1e-30


def check_attention(out, lse, ref, what, arith="fp32"):
    r_out, r_lse, abs_pv, max_s, keys = ref
    out, lse = out.cpu().double(), lse.cpu().double()
    empty = keys == 0
    assert bool(empty.any()), "the test needs a token without a valid slot"
    assert bool(torch.isneginf(lse[empty]).all()) and bool((out[empty] == 0).all()), f"{what}: empty token"
    # Bound: the CPU op sums in fp64 and rounds once, so it is within rounding of any fp64 order; the stated
    # bound is SparseMlaBound's for the arithmetic (fp32 for the CPU: all its terms are fp32 roundings).
    b = sparse_mla_bound(abs_pv, max_s, keys, r_out, arith)
    err = (out - r_out).abs()
    ok = ~empty
    ratio = (err[ok] / b[ok]).max().item()
    lse_err = (lse[ok] - r_lse[ok]).abs().max().item()
    print(f"{what}: max |out - fp64| / bound = {ratio:.3g}, max |lse - fp64| = {lse_err:.3g}")
    assert ratio <= 1.0, f"{what}: out exceeds the bound by {ratio:.3g}x"
    if arith == "fp32_once":
        # the CPU reference: fp64 sums rounded once, so within 2u of any fp64 evaluation (1e-9: fp64 order noise)
        assert bool((err[ok] <= 2 * U * r_out.abs()[ok] + 1e-9 * abs_pv[ok]).all()), f"{what}: not fp64 rounded once"
        assert bool(((lse - r_lse).abs()[ok] <= 2 * U * r_lse.abs()[ok] + 1e-9 * (1 + max_s[ok])).all()), what
    lse_b = ((4 * 576 + 16 if arith == "bf16_mma" else 576 + 8) * U * max_s +
             (2 if arith == "bf16_mma" else 1) * (2 * keys.double().view(-1, 1) + 16 * 256 + 64) * U +
             2 * U * r_lse.abs().nan_to_num(0.0))
    assert bool(((lse - r_lse).abs()[ok] <= lse_b[ok]).all()), f"{what}: lse exceeds its bound"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [pk.CacheFormat("fp8_ds_mla"), pk.CacheFormat("bf16"),
                                 pk.CacheFormat("fp8", k_scale=0.25), pk.CacheFormat("fp8_ds_mla", "raw")],
                         ids=["fp8_ds_mla", "bf16", "fp8", "fp8_ds_mla_raw"])
def test_sparse_mla_matches_fp64(device, fmt):
    w = published(fmt, device, seed=6)
    idx = pk.indexer_topk(**index_inputs(w, 8, seed=7, pad=False), topk=40)  # the indexer's own selection
    q, idx = attention_inputs(w, idx, seed=8)
    T = q.shape[0]
    out = torch.full((T, H_ATTN, 512), 7.0, device=w.device)
    lse = torch.full((T, H_ATTN), 7.0, device=w.device)
    got, got_lse = pk.sparse_mla(q, w.mla[0], idx, fmt=fmt, softmax_scale=SOFTMAX_SCALE, out=out, lse=lse)
    assert got is out and got_lse is lse
    ref = attention_ref(w, q, idx, fmt)
    check_attention(out, lse, ref, f"{device} {fmt.kv_format}/{fmt.ds_mla_scale}",
                    "fp32_once" if device == "cpu" else "bf16_mma")
    if device == "cuda":
        o2, l2 = pk.sparse_mla(q, w.mla[0], idx, fmt=fmt, softmax_scale=SOFTMAX_SCALE, kernel="simt")
        check_attention(o2, l2, ref, f"cuda simt {fmt.kv_format}", "fp32")


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_mla_bf16_scale_read(device):
    """Item 4: FlashMLA's SM90 reader rounds each fp32 tile scale to bf16. pow2 scales are powers of two (bf16
    exact): both reads give the same bits. raw scales (amax / 448) move by up to 2^-8 relative (bf16 round to
    nearest even): the output moves, by at most what those scale errors explain."""
    for mode in ("pow2", "raw"):
        fmt = pk.CacheFormat("fp8_ds_mla", mode)
        w = published(fmt, device, seed=10)
        idx = pk.indexer_topk(**index_inputs(w, 8, seed=11, pad=False), topk=40)
        q, idx = attention_inputs(w, idx, seed=12)
        o32, l32 = pk.sparse_mla(q, w.mla[0], idx, fmt=fmt, softmax_scale=SOFTMAX_SCALE, scale_read="fp32")
        o16, l16 = pk.sparse_mla(q, w.mla[0], idx, fmt=fmt, softmax_scale=SOFTMAX_SCALE, scale_read="bf16")
        scales = pk.mla_cache_view(w.mla[0].cpu(), "fp8_ds_mla")["tile_scales"].reshape(-1, 4)
        used = torch.zeros(scales.shape[0], dtype=torch.bool)
        used[idx.cpu()[idx.cpu() >= 0].long()] = True
        s = scales[used].double()
        scale_rel = ((s.float().bfloat16().double() - s).abs() / s).max().item()
        if mode == "pow2":
            assert scale_rel == 0.0
            assert torch.equal(o32.cpu(), o16.cpu()) and torch.equal(l32.cpu(), l16.cpu()), \
                "pow2 scales must read back exactly through bf16"
            continue
        # the bf16 read is the exact attention over the bf16-rounded scales (within the fp64 bound) ...
        ref16 = attention_ref(w, q, idx, fmt, bf16_scales=True)
        check_attention(o16, l16, ref16, f"{device} raw scales read as bf16",
                        "fp32_once" if device == "cpu" else "bf16_mma")
        if device == "cuda":  # the fp32 kernel's bound is tight enough to tell the two reads apart
            o, l = pk.sparse_mla(q, w.mla[0], idx, fmt=fmt, softmax_scale=SOFTMAX_SCALE, scale_read="bf16",
                                 kernel="simt")
            check_attention(o, l, ref16, "cuda simt raw scales read as bf16", "fp32")
        # ... and differs from the fp32 read by what 2^-8-relative scale errors explain: values move by
        # 2^-8 |v|, scores by 2^-8 max_s (so softmax weights by 2 * 2^-8 max_s, relative).
        _, _, abs_pv, max_s, keys = attention_ref(w, q, idx, fmt)
        ok = keys > 0
        diff = (o16.cpu().double() - o32.cpu().double()).abs()[ok]
        per = 2.0 ** -8 * (1 + 2 * max_s[ok]).unsqueeze(-1) * abs_pv[ok]
        rel = (diff / abs_pv[ok].clamp_min(1e-30)).max().item()
        print(f"raw fp8_ds_mla scales read as bf16: max scale change {scale_rel:.3g} (bound 2^-8 = {2**-8:.3g}), "
              f"max |out_bf16 - out_fp32| / sum_j p_j|v_j| = {rel:.3g}")
        assert 0.0 < scale_rel <= 2.0 ** -8, f"scale change {scale_rel}"
        assert rel > 0.0, "raw scales read through bf16 must change the output"
        assert bool((diff <= per + 1e-6 * abs_pv[ok]).all()), "the output moved more than the scale errors explain"
        assert rel <= 2.0 ** -8 * (1 + 2 * max_s[ok].max().item()), rel


# ---- LSE merge -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_lse_merge_of_shards_equals_full_attention(device):
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = published(fmt, device, seed=13)
    idx = pk.indexer_topk(**index_inputs(w, 8, seed=14, pad=False), topk=40)
    q, idx = attention_inputs(w, idx, seed=15)
    full, full_lse = pk.sparse_mla(q, w.mla[0], idx, fmt=fmt, softmax_scale=SOFTMAX_SCALE)
    # three shards of every token's key set (by index column); the last is empty for tokens with <= 26 keys
    cols = torch.arange(idx.shape[1], device=w.device)
    parts = [torch.where(cols % 2 == 0, idx, -1), torch.where((cols % 2 == 1) & (cols < 26), idx, -1),
             torch.where((cols % 2 == 1) & (cols >= 26), idx, -1)]
    outs = torch.stack([pk.sparse_mla(q, w.mla[0], p, fmt=fmt, softmax_scale=SOFTMAX_SCALE)[0] for p in parts])
    lses = torch.stack([pk.sparse_mla(q, w.mla[0], p, fmt=fmt, softmax_scale=SOFTMAX_SCALE)[1] for p in parts])
    assert bool(torch.isneginf(lses[2]).any()), "the test needs an empty shard"
    out = torch.full_like(full, 7.0)
    lse = torch.full_like(full_lse, 7.0)
    got, got_lse = pk.lse_merge(outs, lses, out=out, lse=lse)
    assert got is out and got_lse is lse
    ref = attention_ref(w, q, idx, fmt)
    abs_pv = ref[2]
    # Bound: every partial and the full result are within their SparseMlaBound of fp64 (fp32 arithmetic on
    # the CPU, the mma one on CUDA); the merge moves the partials' weights by twice their LSE errors and adds
    # its own rounding: SparseMlaBound with dcp_shards, which is below twice the single bound plus 64 u.
    arith = "fp32" if device == "cpu" else "bf16_mma"
    b = 2 * sparse_mla_bound(abs_pv, ref[3], ref[4], ref[0], arith) + 64 * U * abs_pv + 1e-30
    err = (got.cpu().double() - full.cpu().double()).abs()
    ok = ref[4] > 0
    print(f"{device}: merged shards vs full: max err / bound = {(err[ok] / b[ok]).max().item():.3g}")
    assert bool((err[ok] <= b[ok]).all())
    assert bool(torch.isneginf(got_lse.cpu()[~ok]).all()) and bool((got.cpu()[~ok] == 0).all())
    lse_err = (got_lse.cpu().double() - full_lse.cpu().double()).abs()[ok]
    assert bool((lse_err <= 1e-5 * (1 + full_lse.cpu().double().abs()[ok])).all()), lse_err.max()


@pytest.mark.parametrize("device", DEVICES)
def test_lse_merge_matches_fp64(device):
    gen = torch.Generator().manual_seed(16)
    S, T, H, D = 4, 6, 3, 64
    outs = torch.randn(S, T, H, D, generator=gen) * 3
    lses = torch.randn(S, T, H, generator=gen) * 20
    lses[1, 0, 0] = -math.inf
    outs[1, 0, 0] = float("nan")  # an empty shard's out is never read
    lses[2, 1, 1] = float("nan")  # counts as -inf
    outs[2, 1, 1] = float("nan")
    lses[:, 2, 2] = -math.inf     # every shard empty: out 0, lse -inf
    out, lse = pk.lse_merge(outs.to(device), lses.to(device))
    l64 = torch.where(torch.isnan(lses), -math.inf, lses).double()
    L = torch.logsumexp(l64, 0)
    wgt = torch.exp(l64 - L).nan_to_num(0.0)
    o64 = (wgt.unsqueeze(-1) * torch.where(wgt.unsqueeze(-1) > 0, outs.double(), 0.0)).sum(0)
    o64[2, 2] = 0
    assert torch.isneginf(lse[2, 2].cpu()) and bool((out[2, 2] == 0).all())
    tol = 64 * U * ((wgt.unsqueeze(-1) * torch.where(wgt.unsqueeze(-1) > 0, outs.double(), 0.0).abs()).sum(0)
                    * (1 + L.abs().nan_to_num(0.0).unsqueeze(-1))) + 1e-30
    assert bool(((out.cpu().double() - o64).abs() <= tol).all())
    finite = torch.isfinite(L)
    assert bool(((lse.cpu().double() - L).abs()[finite] <= 64 * U * (1 + L.abs()[finite])).all())
    empty = pk.lse_merge(outs[:, :0].to(device), lses[:, :0].to(device))
    assert empty[0].shape == (0, H, D) and empty[1].shape == (0, H)


# ---- CPU vs CUDA -----------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("logit", ["exact", "fp32_tree"])
def test_cuda_indexer_equals_cpu(logit):
    """indexer.h: scores and top-k of the CUDA kernels are bit-identical to indexer_reference; the quantizer too."""
    fmt = pk.CacheFormat("fp8_ds_mla")
    wc, wg = published(fmt, "cpu", seed=17), published(fmt, "cuda", seed=17)
    ic, ig = index_inputs(wc, 16, seed=18), index_inputs(wg, 16, seed=18)
    assert torch.equal(ic["q_fp8"], ig["q_fp8"].cpu()) and torch.equal(ic["q_scale"], ig["q_scale"].cpu())
    pc, pg = torch.empty(ic["q_fp8"].shape[0], 24, dtype=torch.int32), None
    a = pk.indexer_topk(**ic, topk=24, positions_out=pc, logit=logit)
    pg = torch.full_like(pc, POISON_I32).cuda()
    b = pk.indexer_topk(**ig, topk=24, positions_out=pg, logit=logit)
    assert torch.equal(a, b.cpu()) and torch.equal(pc, pg.cpu())


# ---- errors --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_consumer_errors_name_the_argument(device):
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = published(fmt, device, seed=19)
    inp = index_inputs(w, 4, seed=20)
    T = inp["q_fp8"].shape[0]
    out = torch.full((T, 16), POISON_I32, dtype=torch.int32, device=w.device)

    def index_call(match, **over):
        args = dict(inp, topk=16, out=out)
        args.update(over)
        with pytest.raises(ValueError, match=match):
            pk.indexer_topk(**args)
        assert bool((out == POISON_I32).all()), f"{match}: out was written"

    index_call("q_fp8: expected", q_fp8=inp["q_fp8"][:, :, :64].contiguous())
    index_call("num_heads = 129", q_fp8=torch.zeros(T, 129, 128, dtype=torch.uint8, device=w.device))
    index_call("q_scale: expected", q_scale=inp["q_scale"].double())
    index_call("weights: expected", weights=inp["weights"][:, :2].contiguous())
    index_call("positions: expected", positions=inp["positions"].int())
    index_call("request_idx: expected", request_idx=inp["request_idx"].long())
    index_call("block_tables: expected", block_tables=inp["block_tables"].long())
    index_call("index_cache", index_cache=w.mla[0])
    index_call("topk = 0", topk=0)
    index_call("topk = 9000", topk=9000)
    index_call("out: expected", out=out[:, :8])
    index_call("positions_out: expected", positions_out=out.long())
    index_call("logit = 'fast'", logit="fast")
    index_call("max_keys = 0", max_keys=0)
    if device == "cpu":  # values are checked on the host only on the CPU
        bad = inp["positions"].clone()
        bad[3] = 10_000
        index_call(r"positions\[3\] = 10000", positions=bad)
        bad = inp["request_idx"].clone()
        bad[4] = 99
        index_call(r"request_idx\[4\] = 99", request_idx=bad)
        index_call(r"max_keys = 5", max_keys=5)
        bad = inp["block_tables"].clone()
        bad[0, 0] = 10_000
        index_call(r"block_tables\[0, 0\] = 10000", block_tables=bad)
    else:
        index_call("positions: expected", positions=inp["positions"].cpu())

    q = torch.ones(T, H_ATTN, 576, dtype=torch.bfloat16, device=w.device)
    idx = out.clone().fill_(-1)
    o = torch.full((T, H_ATTN, 512), 7.0, device=w.device)
    lse = torch.full((T, H_ATTN), 7.0, device=w.device)

    def attn_call(match, **over):
        args = dict(q=q, mla_cache=w.mla[0], indices=idx, fmt=fmt, softmax_scale=0.1, out=o, lse=lse)
        args.update(over)
        with pytest.raises(ValueError, match=match):
            pk.sparse_mla(**args)
        assert bool((o == 7.0).all()) and bool((lse == 7.0).all()), f"{match}: out / lse written"

    attn_call("q: expected", q=q.float())
    attn_call("q: expected", q=q[:, :, :512].contiguous())
    attn_call("indices: expected", indices=idx.long())
    attn_call("indices: expected", indices=idx[:3])
    attn_call("out: expected", out=o[:, :, :256])
    attn_call("lse: expected", lse=lse.double())
    attn_call("mla_cache", fmt=pk.CacheFormat("bf16"))
    attn_call("softmax_scale = -1", softmax_scale=-1.0)
    attn_call("softmax_scale = nan", softmax_scale=float("nan"))
    # checked as given, not as the float32 the kernels read (1e300 became inf, 1e-50 zero, 1e-40 a subnormal)
    attn_call(r"softmax_scale = 1e\+300 must be a finite, positive, normal float32", softmax_scale=1e300)
    attn_call("softmax_scale = 1e-50 must be", softmax_scale=1e-50)
    attn_call("softmax_scale = 1e-40 must be", softmax_scale=1e-40)
    attn_call("scale_read = 'fp16'", scale_read="fp16")
    attn_call("kernel = 'fast'", kernel="fast")
    # float() took a string and a bool; a format name for fmt raised AttributeError
    attn_call("softmax_scale = '0.1' must be a number", softmax_scale="0.1")
    attn_call("softmax_scale = True must be a number", softmax_scale=True)
    attn_call(r"sparse_mla: fmt = 'fp8_ds_mla' must be a CacheFormat \(e.g. CacheFormat\('fp8_ds_mla'\)",
              fmt="fp8_ds_mla")
    if device == "cpu":
        bad = idx.clone()
        bad[5, 17 % idx.shape[1]] = 1 << 20
        attn_call(r"indices\[5, 1\] = 1048576 is out of range", indices=bad)

    outs = torch.zeros(2, T, H_ATTN, 8, device=w.device)
    lses = torch.zeros(2, T, H_ATTN, device=w.device)
    for match, a, b in [("outs: expected", outs.double(), lses), ("lses: expected", outs, lses[:1]),
                        ("outs: expected", outs[0], lses)]:
        with pytest.raises(ValueError, match=match):
            pk.lse_merge(a, b)
    with pytest.raises(ValueError, match="lse_merge: out: expected"):
        pk.lse_merge(outs, lses, out=torch.zeros(T, H_ATTN, 4, device=w.device))
    with pytest.raises(ValueError, match="num_shards = 0"):
        pk.lse_merge(outs[:0], lses[:0])
    with pytest.raises(ValueError, match="quantize_index_q: q: expected"):
        pk.quantize_index_q(torch.zeros(3, 2, 64, dtype=torch.bfloat16, device=w.device))
    with pytest.raises(ValueError, match="quantize_index_q: q: expected"):
        pk.quantize_index_q(torch.zeros(3, 2, 128, device=w.device))


@pytest.mark.parametrize("device", DEVICES)
def test_consumer_outputs_sharing_memory_are_refused(device):
    """indexer_topk took out = request_idx.view(T, 1) or out = block_tables (wrong slots: rows read what other rows
    had written), sparse_mla an lse inside out: an output sharing memory with an input or another output is refused
    by every consumer op, naming both, with no byte of any argument changed."""
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = published(fmt, device, seed=19)
    inp = index_inputs(w, 4, seed=20)
    T = inp["q_fp8"].shape[0]
    R, S = inp["block_tables"].shape

    def refused(fn, out, other, args):
        before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
        with pytest.raises(ValueError, match=rf"{fn.__name__}: {out} \(.*\) shares memory with {other} \(.*\): an "
                                             rf"output must not overlap"):
            fn(**args)
        for k, v in before.items():
            assert torch.equal(args[k].cpu().contiguous().view(torch.uint8), v.cpu().contiguous().view(torch.uint8)), \
                f"{fn.__name__} {out} / {other}: {k} was written"

    # out in place of an input: the two cases (request_idx as [T, 1]; block_tables as [R, S] = [T, topk])
    refused(pk.indexer_topk, "out", "request_idx", dict(inp, topk=1, out=inp["request_idx"].view(T, 1)))
    bt = torch.cat([inp["block_tables"].flatten(),
                    torch.full((T * S - R * S,), -1, dtype=torch.int32, device=w.device)]).view(T, S)
    refused(pk.indexer_topk, "out", "block_tables", dict(inp, block_tables=bt[:R], topk=S, out=bt))
    refused(pk.indexer_topk, "out", "positions", dict(inp, topk=2, out=inp["positions"].view(torch.int32).view(T, 2)))
    out = torch.full((T, 8), POISON_I32, dtype=torch.int32, device=w.device)
    refused(pk.indexer_topk, "out", "positions_out", dict(inp, topk=8, out=out, positions_out=out))
    refused(pk.indexer_topk, "out", "weights", dict(inp, topk=4, out=inp["weights"].view(torch.int32)))

    q = torch.ones(T, H_ATTN, 576, dtype=torch.bfloat16, device=w.device)
    idx = torch.full((T, 16), -1, dtype=torch.int32, device=w.device)
    o = torch.full((T, H_ATTN, 512), 7.0, device=w.device)
    attn = dict(q=q, mla_cache=w.mla[0], indices=idx, fmt=fmt, softmax_scale=0.1, out=o)
    TH = T * H_ATTN
    refused(pk.sparse_mla, "out", "lse", dict(attn, lse=o.view(-1)[:TH].view(T, H_ATTN)))  # lse a view into out
    refused(pk.sparse_mla, "out", "lse", dict(attn, lse=o.view(-1)[-TH:].view(T, H_ATTN)))  # ... its last bytes
    lse = torch.full((T, H_ATTN), 7.0, device=w.device)
    refused(pk.sparse_mla, "lse", "indices", dict(attn, out=torch.zeros_like(o),
                                                  lse=idx.view(torch.float32).view(-1)[:TH].view(T, H_ATTN)))
    refused(pk.sparse_mla, "out", "q", dict(attn, lse=lse, q=o.view(torch.bfloat16).view(-1)[:TH * 576]
                                            .view(T, H_ATTN, 576)))

    outs = torch.zeros(2, T, H_ATTN, 8, device=w.device)
    lses = torch.zeros(2, T, H_ATTN, device=w.device)
    refused(pk.lse_merge, "out", "outs", dict(outs=outs, lses=lses, out=outs[1]))
    refused(pk.lse_merge, "lse", "lses", dict(outs=outs, lses=lses, lse=lses[0]))
    # the raw quantizer (pk.quantize_index_q allocates its outputs)
    qi = torch.ones(T, 4, 128, dtype=torch.bfloat16, device=w.device)
    with pytest.raises(ValueError, match=r"quantize_index_q: q_scale \(.*\) shares memory with q \("):
        torch.ops.pcpkv.quantize_index_q(qi, torch.empty(T, 4, 128, dtype=torch.uint8, device=w.device),
                                         qi.view(-1)[:2 * T * 4].view(torch.float32).view(T, 4))
    assert bool((qi == 1).all())


@pytest.mark.parametrize("device", DEVICES)
def test_consumers_refuse_meta_tensors_and_bool_topk(device):
    """A meta tensor among real ones ran the consumers' meta kernel (nothing computed, nothing raised), and topk=True
    passed as topk 1: refused naming the argument and its device / value."""
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = published(fmt, device, seed=19)
    inp = index_inputs(w, 4, seed=20)
    T = inp["q_fp8"].shape[0]
    dev = inp["q_fp8"].device
    out = torch.full((T, 16), POISON_I32, dtype=torch.int32, device=w.device)
    for name in ("weights", "positions", "block_tables", "index_cache"):
        with pytest.raises(ValueError, match=f"indexer_topk: {name} is on meta but q_fp8 on {dev}: every tensor"):
            pk.indexer_topk(**{**inp, name: inp[name].to("meta")}, topk=16, out=out)
    with pytest.raises(ValueError, match=f"indexer_topk: out is on meta but q_fp8 on {dev}"):
        pk.indexer_topk(**inp, topk=16, out=out.to("meta"))
    for bad in (True, False):
        with pytest.raises(ValueError, match=f"indexer_topk: topk = {bad} must be an int in"):
            pk.indexer_topk(**inp, topk=bad, out=out[:, :1])
    with pytest.raises(ValueError, match="indexer_topk: max_keys = True must be an int"):
        pk.indexer_topk(**inp, topk=16, out=out, max_keys=True)
    assert bool((out == POISON_I32).all()), "out was written"
    q = torch.ones(T, H_ATTN, 576, dtype=torch.bfloat16, device=w.device)
    o = torch.full((T, H_ATTN, 512), 7.0, device=w.device)
    with pytest.raises(ValueError, match=f"sparse_mla: mla_cache is on meta but q on {dev}"):
        pk.sparse_mla(q, w.mla[0].to("meta"), out[:, :4].contiguous(), fmt=fmt, softmax_scale=0.1, out=o)
    with pytest.raises(ValueError, match=f"lse_merge: lses is on meta but outs on {dev}"):
        pk.lse_merge(torch.zeros(2, T, H_ATTN, 8, device=w.device), torch.zeros(2, T, H_ATTN, device="meta"))
    with pytest.raises(ValueError, match=f"quantize_index_q: q_scale is on meta but q on {dev}"):
        torch.ops.pcpkv.quantize_index_q(q[:, :, :128].contiguous(), torch.empty(T, H_ATTN, 128, dtype=torch.uint8,
                                                                                device=w.device),
                                         torch.empty(T, H_ATTN, device="meta"))
    assert bool((o == 7.0).all())
    # all on meta (meta tracing): passes, does nothing
    m = {k: v.to("meta") for k, v in inp.items()}
    assert pk.indexer_topk(**m, topk=16).device.type == "meta"


# ---- torch.compile -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_consumers_opcheck_and_compile(device):
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = published(fmt, device, seed=21)
    inp = index_inputs(w, 4, seed=22)
    q, _ = attention_inputs(w, torch.zeros(inp["q_fp8"].shape[0], 16, dtype=torch.int32), seed=23)
    T = q.shape[0]
    topk = torch.empty(T, 16, dtype=torch.int32, device=w.device)
    torch.library.opcheck(torch.ops.pcpkv.indexer_topk.default,
                          (inp["q_fp8"], inp["q_scale"], inp["weights"], inp["positions"], inp["request_idx"],
                           inp["block_tables"], inp["index_cache"], topk, None, 16, None, "exact"))
    idx = pk.indexer_topk(**inp, topk=16)
    o = torch.empty(T, H_ATTN, 512, device=w.device)
    lse = torch.empty(T, H_ATTN, device=w.device)
    torch.library.opcheck(torch.ops.pcpkv.sparse_mla.default,
                          (q, w.mla[0], idx, o, lse, fmt.kv_format, fmt.ds_mla_scale, fmt.k_scale, SOFTMAX_SCALE,
                           "fp32", "mma"))
    torch.library.opcheck(torch.ops.pcpkv.lse_merge.default,
                          (torch.stack([o, o]), torch.stack([lse, lse]), torch.empty_like(o), torch.empty_like(lse)))
    qi = llm_like(torch.Generator().manual_seed(1), T * 4, 128).view(T, 4, 128).to(w.device)
    torch.library.opcheck(torch.ops.pcpkv.quantize_index_q.default,
                          (qi, torch.empty(T, 4, 128, dtype=torch.uint8, device=w.device),
                           torch.empty(T, 4, device=w.device)))

    def layer(qi, weights):
        q_fp8, q_scale = pk.quantize_index_q(qi)
        sel = pk.indexer_topk(q_fp8, q_scale, weights, inp["positions"], inp["request_idx"], inp["block_tables"],
                              inp["index_cache"], topk=16)
        halves = [torch.where(torch.arange(16, device=sel.device) % 2 == n, sel, -1) for n in range(2)]
        parts = [pk.sparse_mla(q, w.mla[0], h, fmt=fmt, softmax_scale=SOFTMAX_SCALE) for h in halves]
        return pk.lse_merge(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))

    eager = layer(qi, inp["weights"])
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")(qi, inp["weights"])
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def _dispatch_topk(w, topk, mode, rows, seed=23):
    """The dispatch of T seeded rows (materializing index_k, no cache write) whose only other output is the
    poisoned top-k buffer `topk` [T, width]: fill mode `mode` (topk_indexer_rows = rows)."""
    gen = torch.Generator().manual_seed(seed)
    T, dev = topk.shape[0], w.device
    max_pos = w.rope_cos_sin.shape[0]
    positions = (torch.arange(T) * 7 % max_pos).long().to(dev)
    kw = dict(topk_fill_mode=mode) if mode is not None else {}
    if rows is not None:
        kw["topk_indexer_rows"] = rows
    pk.dispatch(llm_like(gen, T, 512).to(dev), llm_like(gen, T, 64).to(dev), positions, w.weights["kv_norm_w"],
                w.rope_cos_sin, fmt=w.fmt, index_k=llm_like(gen, T, 128).to(dev), index_ln_w=w.weights["index_ln_w"],
                index_ln_b=w.weights["index_ln_b"],
                index_k_out=torch.empty(T, 128, dtype=torch.bfloat16, device=dev), topk_fill=topk, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_topk_fill_tail_then_indexer_equals_full(device):
    """Issue 17 item 1: dispatch(topk_fill_mode='tail', topk_indexer_rows=n) + indexer_topk over rows [0, n) of
    the same poisoned buffer == full fill + indexer_topk, byte for byte (rows of requests shorter and longer than
    topk, a request -1 row, padding rows past the step's tokens; the C++ tests add decodes); each mode writes
    exactly its rows."""
    w = published(pk.CacheFormat("fp8_ds_mla"), device, seed=21)
    inp = index_inputs(w, 8, seed=22, pad=True)  # the plan's tokens (short and long requests, decodes) + a -1 row
    n, topk = inp["positions"].numel(), 24
    assert (inp["positions"] + 1 < topk).any() and (inp["positions"] + 1 > topk).any()
    T = n + 5  # padding rows no indexer visits

    def run(mode, rows, indexer=True):
        buf = torch.full((T, topk), POISON_I32, dtype=torch.int32, device=w.device)
        _dispatch_topk(w, buf, mode, rows)
        if indexer:
            assert pk.indexer_topk(**inp, topk=topk, out=buf[:n]).data_ptr() == buf.data_ptr()
        return buf.cpu()

    full = run(None, None)  # the default is full
    assert torch.equal(full, run("full", None))
    assert torch.equal(full, run("tail", n)), "tail + indexer differs from full + indexer"
    assert (full[n:] == -1).all() and (full[:n] >= 0).any() and (full[:n] == -1).any()
    fill = run("tail", n, indexer=False)
    assert (fill[:n] == POISON_I32).all() and (fill[n:] == -1).all()
    assert (run("tail", 0, indexer=False) == -1).all()
    assert (run("none", None, indexer=False) == POISON_I32).all()
    assert not torch.equal(full, run("none", None)), "none leaves the padding rows to nobody"


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_topk_fill_errors_name_the_argument(device):
    w = World(plan_of(), pk.CacheFormat("fp8_ds_mla"), device, seed=3)
    buf = torch.full((6, 8), POISON_I32, dtype=torch.int32, device=w.device)
    for mode, rows, part in [("Tail", None, "topk_fill_mode = 'Tail'"), ("tail", None, "topk_indexer_rows = None"),
                             ("tail", 7, "topk_indexer_rows = 7 must be an int in [0, num_tokens = 6]"),
                             ("tail", -1, "topk_indexer_rows = -1"), ("tail", 2.0, "topk_indexer_rows = 2.0"),
                             ("full", 3, "only used by topk_fill_mode 'tail'")]:
        with pytest.raises(ValueError, match=part.replace("[", r"\[").replace("(", r"\(")):
            _dispatch_topk(w, buf, mode, rows)
        assert (buf == POISON_I32).all(), f"{mode} {rows}: written before the error"
