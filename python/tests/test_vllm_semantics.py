"""pcpkv_torch.vllm.fused_norm_rope against a plain-torch emulation of what vLLM's kernel computes (its
per-token math and byte layout as read from vllm c73a651, written here in fp32 torch ops): the bytes agree
up to float order. This checks the mapping itself (cos/sin halves, rotation styles, cache layouts, slots,
shared layers), which the comparison with pcpkv's own op cannot."""

import pytest

from helpers import DEVICES, GUARD, pk, torch
from test_vllm_dropin import BLOCK_SIZE, T, clone_outputs, vllm_inputs

from pcpkv_torch.vllm import fused_norm_rope

FLT_MIN = torch.finfo(torch.float32).tiny


def rope_pairs(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def emulate(a):
    """(q_c_out, mla_kv_cache bytes, indexer_k_cache bytes, top-k buffer) that vLLM's kernel would leave,
    computed on the CPU in fp32 from a's inputs (caches start as a's)."""
    f = lambda t: t.detach().cpu().float()  # noqa: E731
    q = f(a["q_c"])
    q_out = (q * torch.rsqrt((q * q).mean(-1, keepdim=True) + a["q_rms_eps"]) * f(a["q_rms_norm_w"])).bfloat16()
    mla = a["mla_kv_cache"].detach().cpu().clone().view(torch.uint8)
    idx = a["indexer_k_cache"].detach().cpu().clone()
    topk = a["topk_indices_buffer"].detach().cpu().clone()
    if a["has_indexer"]:
        topk[:T] = -1
    table = f(a["k_rope_cos_sin_cache"])
    kind = a["mla_kv_cache_dtype"]
    k_scale = float(a["mla_k_scale"]) if a["mla_k_scale"] is not None else 1.0
    bs = mla.shape[1]
    for t in range(T):
        slot = int(a["slot_mapping"][t])
        if slot < 0:
            continue
        pos = int(a["positions"][t])
        cos, sin = table[pos, :32], table[pos, 32:]
        x = f(a["kv_c"][t])
        kv = x * torch.rsqrt((x * x).mean() + a["kv_rms_eps"]) * f(a["kv_rms_norm_w"])
        pe = f(a["k_pe"][t])
        r1, r2 = rope_pairs(pe[0::2], pe[1::2], cos, sin)
        roped = torch.stack([r1, r2], -1).reshape(64)
        row = mla[slot // bs, slot % bs]
        if kind == "fp8_ds_mla":
            tiles = kv.view(4, 128)
            scale = torch.clamp(tiles.abs().amax(1, keepdim=True) * torch.tensor(1.0 / 448.0), min=FLT_MIN)
            row[:512] = (tiles / scale).to(torch.float8_e4m3fn).view(torch.uint8).reshape(512)
            row[512:528] = scale.reshape(4).view(torch.uint8)
            row[528:656] = roped.bfloat16().view(torch.uint8)
        elif kind == "auto":
            row[:] = torch.cat([kv, roped]).bfloat16().view(torch.uint8)
        else:
            row[:] = (torch.cat([kv, roped]) / k_scale).to(torch.float8_e4m3fn).view(torch.uint8)
        if not a["has_indexer"]:
            continue
        k = f(a["index_k"][t])
        mean = k.mean()
        n = (k - mean) * torch.rsqrt(((k - mean) ** 2).mean() + a["index_k_layer_norm_eps"]) * \
            f(a["index_k_layer_norm_w"]) + f(a["index_k_layer_norm_bias"])
        out = n.clone()
        if a["index_rope_interleave"]:
            out[0:64:2], out[1:64:2] = rope_pairs(n[0:64:2], n[1:64:2], cos, sin)
        else:  # NeoX: pairs (d, d + 32)
            out[:32], out[32:64] = rope_pairs(n[:32], n[32:64], cos, sin)
        s = torch.exp2(torch.ceil(torch.log2(torch.clamp(out.abs().amax(), min=1e-4) / 448.0)))
        base = idx[slot // bs].reshape(-1)
        o = slot % bs
        base[o * 128:(o + 1) * 128] = (out / s).to(torch.float8_e4m3fn).view(torch.uint8)
        base[bs * 128 + o * 4:bs * 128 + o * 4 + 4] = s.reshape(1).view(torch.uint8)
    return q_out, mla, idx, topk


def near_bytes(got, want, what, *, kind, max_frac, ulps=1):
    """Equal but for float order: at most max_frac of the elements differ, each by at most `ulps` steps of its
    type (e4m3: one code)."""
    g, w = got.reshape(-1), want.reshape(-1)
    if kind == "e4m3":  # sign-magnitude codes: one step = adjacent magnitude, same sign
        diff = g != w
        step = ((g & 0x80) == (w & 0x80)) & (((g & 0x7F).int() - (w & 0x7F).int()).abs() <= 1)
    else:
        dt = {"bf16": (torch.bfloat16, torch.int16), "f32": (torch.float32, torch.int32)}[kind]
        gi, wi = g.view(dt[1]), w.view(dt[1])
        diff = gi != wi
        step = (gi.long() - wi.long()).abs() <= ulps
    assert bool((step | ~diff).all()), f"{what}: an element differs by more than {ulps} step(s)"
    frac = diff.float().mean().item()
    assert frac <= max_frac, f"{what}: {frac:.3%} of elements differ (allowed {max_frac:.1%})"
    return frac


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype, has_indexer, interleave",
                         [("fp8_ds_mla", True, False), ("fp8_ds_mla", True, True), ("fp8_ds_mla", False, False),
                          ("fp8", True, False), ("auto", True, False)])
def test_bytes_match_vllm_math(device, kv_dtype, has_indexer, interleave):
    a = vllm_inputs(device, kv_dtype, seed=11, has_indexer=has_indexer)
    a["index_rope_interleave"] = interleave
    got = clone_outputs(a)
    fused_norm_rope(**got)
    q_out, mla, idx, topk = emulate(a)
    near_bytes(got["q_c_out"].cpu().view(torch.uint8).view(torch.bfloat16), q_out, "q_c_out", kind="bf16",
               max_frac=0.02)
    assert torch.equal(got["topk_indices_buffer"].cpu(), topk), "topk_indices_buffer"
    g_mla = got["mla_kv_cache"].cpu().view(torch.uint8)
    written = torch.zeros(g_mla.shape[:2], dtype=torch.bool).reshape(-1)
    written[a["slot_mapping"].cpu()[a["slot_mapping"].cpu() >= 0]] = True
    written = written.view(g_mla.shape[:2])
    assert bool((g_mla[~written] == GUARD).all()) and torch.equal(g_mla[~written], mla[~written]), "unwritten slots"
    g, w = g_mla[written], mla[written]
    if kv_dtype == "fp8_ds_mla":
        near_bytes(g[:, :512], w[:, :512], "kv_c e4m3", kind="e4m3", max_frac=0.01)
        # vLLM's scale is amax * (1/448), pcpkv's amax / 448 (one ulp apart for about half the tiles), and the
        # RMSNorm's 512-term sum in another order moves a row's amax by a few ulps.
        near_bytes(g[:, 512:528].contiguous().view(torch.float32), w[:, 512:528].contiguous().view(torch.float32),
                   "tile scales", kind="f32", max_frac=0.9, ulps=8)
        near_bytes(g[:, 528:].contiguous().view(torch.bfloat16), w[:, 528:].contiguous().view(torch.bfloat16),
                   "k_pe bf16", kind="bf16", max_frac=0.02)
    elif kv_dtype == "auto":
        near_bytes(g.contiguous().view(torch.bfloat16), w.contiguous().view(torch.bfloat16), "bf16 row", kind="bf16",
                   max_frac=0.02)
    else:
        near_bytes(g, w, "fp8 row", kind="e4m3", max_frac=0.01)
    g_idx = got["indexer_k_cache"].cpu()
    if not has_indexer:
        assert bool((g_idx == GUARD).all()), "a shared layer wrote the indexer cache"
        return
    per_block = g_idx.reshape(g_idx.shape[0], -1)
    want_block = idx.reshape(idx.shape[0], -1)
    for slot in a["slot_mapping"].cpu().tolist():
        if slot < 0:
            continue
        b, o = divmod(slot, BLOCK_SIZE)
        data = slice(o * 128, (o + 1) * 128)
        sc = slice(BLOCK_SIZE * 128 + o * 4, BLOCK_SIZE * 128 + o * 4 + 4)
        near_bytes(per_block[b, data], want_block[b, data], f"index K slot {slot}", kind="e4m3", max_frac=0.03)
        assert torch.equal(per_block[b, sc], want_block[b, sc]), f"index scale slot {slot}"
