"""pcpkv's math against an implementation we did not write: HF transformers' GlmMoeDsaAttention and
DeepseekV32Attention (transformers 5.17), small random weights (hidden 256, two heads; kv_lora_rank 512,
rope 64, index_head_dim 128 as in the real models), their own norms and RoPE on random inputs.

Compared quantities (per token): normalized q_c, normalized kv_c, roped k_pe, normalized + roped indexer K.
  * HF in float32 (its math with no bf16 rounding): pcpkv's bf16 outputs are one bf16 rounding away, plus
    float32-order noise: |pcpkv - hf| <= 2^-8 |hf| + rope_slack + 2^-18 rowmax|hf|, where rope_slack =
    (|x0| + |x1|) * (pos * f_i * 2^-20 + 2^-22) on rotary dims covers HF's float32 inv_freq and angle
    pos * f_i (a few float32 ulps of the angle) against pcpkv's long-double table rounded once.
  * HF in bfloat16 (what a bf16 deployment of the HF model computes): HF's RMSNorm rounds x * rsqrt to bf16
    before multiplying by the weight and rounds again after (pcpkv keeps fp32 and rounds once), and its RoPE
    rounds cos/sin, both products and the sum to bf16: |pcpkv - hf| <= 2^-6 |hf| for norms,
    2^-6 (|x0| + |x1|) + 2^-7 |hf| + rope_slack for rotary dims, 2^-7 |hf| + 2^-16 rowmax for LayerNorm.
  * After quantization (fp8_ds_mla cache + indexer cache, and static fp8), the dequantized cache against HF
    float32: |deq - hf| <= 2^-4 |hf| + 2^-10 scale (E4M3 half ulp, subnormal half step) + the float32 slack;
    k_pe of fp8_ds_mla is bf16 (the float32 bound).
Every comparison counts the values over its bound and requires zero.

RoPE layout: HF's apply_rotary_pos_emb_interleave rotates interleaved pairs (2i, 2i+1) but emits them
de-interleaved ([rotated evens | rotated odds]); pcpkv rotates in place (SPEC 2.3), so HF's output is
re-interleaved before comparing. Attention scores are unchanged by that permutation (q gets the same one).
Indexer RoPE style per model, read from HF 5.17: DeepseekV32Indexer uses apply_rotary_pos_emb (NeoX half
split), GlmMoeDsaIndexer uses apply_rotary_pos_emb_interleave (interleaved), matching SPEC section 1.
Both styles are run against both models' HF functions below.
"""

import pytest

from helpers import DEVICES, llm_like, pk, poisoned_bf16, torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
glm = pytest.importorskip("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
                          reason="transformers has no glm_moe_dsa (needs >= 5.x)")
ds = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32",
                         reason="transformers has no deepseek_v32 (needs >= 5.x)")

T = 96  # tokens
HIDDEN = 256
Q_LORA = 384


def make_config(model):
    common = dict(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=Q_LORA,
                  kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, index_n_heads=2,
                  index_head_dim=128, index_topk=64, num_hidden_layers=1, vocab_size=64, intermediate_size=64,
                  moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=16384)
    if model == "glm":
        return glm.GlmMoeDsaConfig(rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                   **common)
    return ds.DeepseekV32Config(
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        **common)


def build(model, seed):
    torch.manual_seed(seed)
    cfg = make_config(model)
    mod = glm if model == "glm" else ds
    attn = (mod.GlmMoeDsaAttention if model == "glm" else mod.DeepseekV32Attention)(cfg, layer_idx=0)
    rotary = (mod.GlmMoeDsaRotaryEmbedding if model == "glm" else mod.DeepseekV32RotaryEmbedding)(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for lin in (attn.q_a_proj, attn.kv_a_proj_with_mqa, attn.indexer.wk):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * HIDDEN ** -0.5)
            lin.weight[:3] *= 20.0  # outlier channels
        for norm in (attn.q_a_layernorm, attn.kv_a_layernorm, attn.indexer.k_norm):
            norm.weight.copy_((1 + 0.25 * torch.randn(norm.weight.shape, generator=gen)).bfloat16().float())
        attn.indexer.k_norm.bias.copy_((0.1 * torch.randn(128, generator=gen)).bfloat16().float())
    return cfg, mod, attn, rotary


def interleave(x):
    """HF's de-interleaved [evens | odds] rope output -> pcpkv's in-place pair layout."""
    return torch.stack([x[..., :32], x[..., 32:]], dim=-1).flatten(-2)


def hf_outputs(mod, attn, rotary, inputs, positions, dtype, index_interleaved):
    """HF's own modules/functions in `dtype` on the bf16 raw projections."""
    a = attn.to(dtype)
    q_c, kv, k_pe, idx = (inputs[k].to(dtype)[None] for k in ("q_c", "kv", "k_pe", "index_k"))
    cos, sin = rotary(q_c, positions[None])  # returned in the activation dtype, as in the model
    q = a.q_a_layernorm(q_c)[0]
    kv_c = a.kv_a_layernorm(kv)[0]
    k_rot = k_pe.view(1, 1, T, 64)
    _, k_rot = mod.apply_rotary_pos_emb_interleave(k_rot, k_rot, cos, sin)
    k_pe_out = interleave(k_rot[0, 0])
    k = a.indexer.k_norm(idx).unsqueeze(2)
    ir, ip = torch.split(k, [64, 64], dim=-1)
    if index_interleaved:
        _, ir = glm.apply_rotary_pos_emb_interleave(ir, ir, cos, sin, unsqueeze_dim=2)
        ir = interleave(ir)
    else:
        _, ir = ds.apply_rotary_pos_emb(ir, ir, cos, sin, unsqueeze_dim=2)
    index_k = torch.cat([ir, ip], dim=-1)[0, :, 0]
    attn.float()
    return dict(q=q.float(), kv_c=kv_c.float(), k_pe=k_pe_out.float(), index_k=index_k.float())


def rope_slack(x_bf16, positions, inv_freq, interleaved):
    """(|x0| + |x1|) * (pos * f_i * 2^-20 + 2^-22) per rotary element, in pcpkv's output layout."""
    x = x_bf16.double().abs()
    if interleaved:
        pair = x[:, 0::2] + x[:, 1::2]  # [T, 32]
        mag = torch.stack([pair, pair], -1).flatten(-2)
    else:
        pair = x[:, :32] + x[:, 32:64]
        mag = torch.cat([pair, pair], -1)
    f = inv_freq.double()
    f = torch.stack([f, f], -1).flatten(-2) if interleaved else torch.cat([f, f], -1)
    return mag * (positions.double()[:, None] * f[None] * 2.0 ** -20 + 2.0 ** -22)


def count_over(got, want, bound, name):
    err = (got.double() - want.double()).abs()
    over = err > bound
    n = int(over.sum())
    worst = float((err / bound.clamp_min(1e-300)).max())
    assert n == 0, f"{name}: {n} of {err.numel()} values over the bound (max err/bound {worst:.3g})"
    return worst


def pcpkv_run(inputs, positions, cfg, attn, spec, device, kv_format, k_scale=1.0):
    d = torch.device(device)
    fmt = pk.CacheFormat(kv_format, k_scale=k_scale)
    rope = pk.rope_table(spec.rope, int(positions.max()) + 1, d)
    out = dict(q=poisoned_bf16(T, Q_LORA, d),
               kv_c=poisoned_bf16(T, 512, d),
               k_pe=poisoned_bf16(T, 64, d),
               index_k=poisoned_bf16(T, 128, d))
    mla = pk.allocate_mla_cache(T // 16 + 1, 16, kv_format, d, fill=0xA5)
    ic = pk.allocate_indexer_cache(T // 16 + 1, 16, d, fill=0xA5)
    slots = torch.randperm(mla.shape[0] * 16, generator=torch.Generator().manual_seed(3))[:T].to(d)
    targets = pk.CacheTargets.from_caches([mla], [ic], fmt)
    pk.dispatch(inputs["kv"].to(d), inputs["k_pe"].to(d), positions.to(d), attn.kv_a_layernorm.weight.detach().to(d),
                rope, fmt=fmt, q_c=inputs["q_c"].to(d), q_norm_w=attn.q_a_layernorm.weight.detach().to(d),
                index_k=inputs["index_k"].to(d), index_ln_w=attn.indexer.k_norm.weight.detach().to(d),
                index_ln_b=attn.indexer.k_norm.bias.detach().to(d), slot_mapping=slots, targets=targets,
                q_c_out=out["q"], kv_c_out=out["kv_c"], k_pe_out=out["k_pe"], index_k_out=out["index_k"],
                **spec.dispatch_kwargs())
    res = {k: v.float().cpu() for k, v in out.items()}
    kv_deq, kpe_deq = pk.dequantize_mla(mla, kv_format, k_scale, slots=slots)
    res["kv_c_deq"], res["k_pe_deq"] = kv_deq.cpu(), kpe_deq.cpu()
    res["index_k_deq"] = pk.dequantize_indexer(ic, slots=slots).cpu()
    view = pk.mla_cache_view(mla, kv_format)
    if kv_format == "fp8_ds_mla":
        s = view["tile_scales"].reshape(-1, 4)[slots].cpu()
        res["kv_c_scale"] = s.repeat_interleave(128, dim=1)
    else:
        res["kv_c_scale"] = torch.full((T, 512), k_scale)
    _, iscale = pk.indexer_cache_view(ic)
    res["index_scale"] = iscale.reshape(-1)[slots].cpu()[:, None].expand(T, 128)
    return res


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["glm", "deepseek"])
def test_matches_hf_modules(model, device):
    cfg, mod, attn, rotary = build(model, seed=11 if model == "glm" else 12)
    spec = pk.ModelSpec.from_hf_config(cfg.to_dict() | {"model_type": cfg.model_type})
    # SPEC section 1 and HF agree on the indexer rope style of each model.
    assert spec.indexer_rope_interleave == (model == "glm")
    gen = torch.Generator().manual_seed(5)
    x = llm_like(gen, T, HIDDEN).float()
    with torch.no_grad():
        inputs = dict(q_c=attn.q_a_proj(x).bfloat16(), index_k=attn.indexer.wk(x).bfloat16())
        kv, k_pe = torch.split(attn.kv_a_proj_with_mqa(x), [512, 64], dim=-1)
        inputs["kv"], inputs["k_pe"] = kv.bfloat16().contiguous(), k_pe.bfloat16().contiguous()
        positions = torch.randint(0, 12000, (T,), generator=gen)  # past YaRN's original 4096
        ref32 = hf_outputs(mod, attn, rotary, inputs, positions, torch.float32, spec.indexer_rope_interleave)
        ref16 = hf_outputs(mod, attn, rotary, inputs, positions, torch.bfloat16, spec.indexer_rope_interleave)
    inv_freq = rotary.inv_freq.float()
    got = pcpkv_run(inputs, positions, cfg, attn, spec, device, "fp8_ds_mla")

    def rowmax(t):
        return t.abs().amax(dim=1, keepdim=True).double()

    kslack = rope_slack(inputs["k_pe"], positions, inv_freq, True)
    islack = torch.zeros(T, 128, dtype=torch.float64)
    # post-rope |r0| + |r1| >= (|x0| + |x1|) / sqrt(2): twice the slack of the rotated values covers it
    islack[:, :64] = 2 * rope_slack(ref32["index_k"][:, :64], positions, inv_freq, spec.indexer_rope_interleave)
    # 1) before quantization, against HF float32
    for k, slack in (("q", 0), ("kv_c", 0), ("k_pe", kslack), ("index_k", islack)):
        bound = 2.0 ** -8 * ref32[k].abs().double() + slack + 2.0 ** -18 * rowmax(ref32[k])
        count_over(got[k], ref32[k], bound, f"{model} {k} vs HF fp32")
    # 2) before quantization, against HF bfloat16
    for k in ("q", "kv_c"):
        count_over(got[k], ref16[k], 2.0 ** -6 * ref16[k].abs().double() + 2.0 ** -30, f"{model} {k} vs HF bf16")
    kmag = rope_slack(inputs["k_pe"], positions, torch.zeros_like(inv_freq), True) * 2.0 ** 22  # |x0| + |x1|
    count_over(got["k_pe"], ref16["k_pe"], 2.0 ** -6 * kmag + 2.0 ** -7 * ref16["k_pe"].abs().double() + kslack,
               f"{model} k_pe vs HF bf16")
    imag = torch.zeros(T, 128, dtype=torch.float64)
    imag[:, :64] = 2 * rope_slack(ref32["index_k"][:, :64], positions, torch.zeros_like(inv_freq),
                              spec.indexer_rope_interleave) * 2.0 ** 22
    count_over(got["index_k"], ref16["index_k"], 2.0 ** -6 * imag + 2.0 ** -7 * ref16["index_k"].abs().double() +
               islack + 2.0 ** -16 * rowmax(ref16["index_k"]), f"{model} index_k vs HF bf16")
    # 3) after quantization, dequantized against HF float32
    for k, scale, slack in (("kv_c", got["kv_c_scale"], 0), ("index_k", got["index_scale"], islack)):
        bound = (2.0 ** -4 * ref32[k].abs().double() + 2.0 ** -10 * scale.double() + slack +
                 2.0 ** -18 * rowmax(ref32[k]))
        count_over(got[k + "_deq"], ref32[k], bound, f"{model} {k} dequantized vs HF fp32")
    count_over(got["k_pe_deq"], ref32["k_pe"], 2.0 ** -8 * ref32["k_pe"].abs().double() + kslack,
               f"{model} k_pe (bf16 in fp8_ds_mla) vs HF fp32")
    # 4) static fp8: every value x / k_scale in E4M3 (k_scale keeps the largest value below 448)
    k_scale = float(max(ref32["kv_c"].abs().max(), ref32["k_pe"].abs().max())) / 400.0
    got8 = pcpkv_run(inputs, positions, cfg, attn, spec, device, "fp8", k_scale)
    for k, slack in (("kv_c", 0), ("k_pe", kslack)):
        bound = 2.0 ** -4 * ref32[k].abs().double() + 2.0 ** -10 * k_scale + slack + 2.0 ** -18 * rowmax(ref32[k])
        count_over(got8[k + "_deq"], ref32[k], bound, f"{model} {k} static fp8 dequantized vs HF fp32")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_indexer_rope_styles_match_hf_functions(style, device):
    """Both indexer RoPE styles against HF's function for that style (NeoX: DeepseekV32's
    apply_rotary_pos_emb; interleaved: GlmMoeDsa's apply_rotary_pos_emb_interleave), on one model config."""
    cfg, mod, attn, rotary = build("deepseek", seed=21)
    spec = pk.ModelSpec.from_hf_config(cfg.to_dict() | {"model_type": cfg.model_type,
                                                        "indexer_rope_interleave": style == "interleaved"})
    gen = torch.Generator().manual_seed(6)
    x = llm_like(gen, T, HIDDEN).float()
    with torch.no_grad():
        inputs = dict(q_c=attn.q_a_proj(x).bfloat16(), index_k=attn.indexer.wk(x).bfloat16())
        kv, k_pe = torch.split(attn.kv_a_proj_with_mqa(x), [512, 64], dim=-1)
        inputs["kv"], inputs["k_pe"] = kv.bfloat16().contiguous(), k_pe.bfloat16().contiguous()
        positions = torch.randint(0, 8000, (T,), generator=gen)
        ref32 = hf_outputs(mod, attn, rotary, inputs, positions, torch.float32, style == "interleaved")
    got = pcpkv_run(inputs, positions, cfg, attn, spec, device, "fp8_ds_mla")
    islack = torch.zeros(T, 128, dtype=torch.float64)
    islack[:, :64] = 2 * rope_slack(ref32["index_k"][:, :64], positions, rotary.inv_freq.float(),
                                    style == "interleaved")
    bound = 2.0 ** -8 * ref32["index_k"].abs().double() + islack + 2.0 ** -18 * ref32["index_k"].abs().amax(
        dim=1, keepdim=True).double()
    count_over(got["index_k"], ref32["index_k"], bound, f"index_k {style} vs HF fp32")
    # The other style must NOT match (the test can tell the styles apart).
    other = pcpkv_run(inputs, positions, cfg, attn, pk.ModelSpec.from_hf_config(
        cfg.to_dict() | {"model_type": cfg.model_type, "indexer_rope_interleave": style != "interleaved"}),
        device, "fp8_ds_mla")
    assert int(((other["index_k"].double() - ref32["index_k"].double()).abs() > bound).sum()) > 100
