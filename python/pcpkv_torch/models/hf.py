"""HF transformers models to run under PCP: small configs with the real per-layer cache dims, and seeded random
weights with outlier channels (no checkpoint is downloaded; transformers >= 5.17 builds the modules).

The per-layer dims that fix pcpkv's cache layouts (SPEC section 3) stay real in every config made here:
kv_lora_rank 512, qk_rope_head_dim 64, index_head_dim 128; q_lora_rank is the model's (1536 DeepSeek-V3.2,
2048 GLM-5). What is shrunk (hidden size, heads, experts, vocabulary) only scales the projections.
"""

from __future__ import annotations

import torch

__all__ = ["MODEL_TYPES", "hf_modules", "small_config", "build_hf_model", "randomize_weights"]

#: CLI-style model names -> HF model_type.
MODEL_TYPES = {"glm-5": "glm_moe_dsa", "deepseek-v3.2": "deepseek_v32"}


def hf_modules(model_type: str):
    """(config class, causal-LM class) of a model_type. Raises ValueError for another type and ImportError
    (with the reason) when the installed transformers lacks the model (needs >= 5.17)."""
    if model_type == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m
        return m.GlmMoeDsaConfig, m.GlmMoeDsaForCausalLM
    if model_type == "deepseek_v32":
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m
        return m.DeepseekV32Config, m.DeepseekV32ForCausalLM
    raise ValueError(f"model_type = {model_type!r}; expected 'glm_moe_dsa' or 'deepseek_v32'")


def small_config(model: str, *, num_layers: int = 4, hidden_size: int = 512, num_heads: int = 4,
                 index_n_heads: int = 4, index_topk: int = 64, vocab_size: int = 512, num_experts: int = 4,
                 intermediate_size: int = 256, moe_intermediate_size: int = 128, first_dense: int = 1,
                 index_share: bool = True, max_position_embeddings: int | None = None, **overrides):
    """A HF config of `model` ("glm-5" or "deepseek-v3.2") with the real per-layer cache dims and the model's
    q_lora_rank, norms eps, head dims and RoPE (SPEC section 1), scaled down elsewhere. GLM-5 with
    index_share gets the IndexShare pattern (index_topk_freq 2, offset 1: layers 0, 1, 3 run an indexer,
    layer 2 reuses layer 1's top-k) so shared layers are exercised. `overrides` go to the config as given."""
    if model not in MODEL_TYPES:
        raise ValueError(f"model = {model!r}; expected one of {sorted(MODEL_TYPES)}")
    config_cls, _ = hf_modules(MODEL_TYPES[model])
    common = dict(hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                  kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_n_heads=index_n_heads,
                  index_topk=index_topk, num_hidden_layers=num_layers, vocab_size=vocab_size,
                  intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
                  n_routed_experts=num_experts, num_experts_per_tok=min(2, num_experts), n_shared_experts=1,
                  first_k_dense_replace=first_dense, tie_word_embeddings=False)
    if model == "glm-5":
        common.update(max_position_embeddings=max_position_embeddings or 202752, q_lora_rank=2048,
                      qk_nope_head_dim=192, v_head_dim=256, rms_norm_eps=1e-5,
                      n_group=1, topk_group=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        if index_share:
            common.update(index_topk_freq=2, index_skip_topk_offset=1)
    else:
        common.update(max_position_embeddings=max_position_embeddings or 163840, q_lora_rank=1536,
                      qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6,
                      n_group=1, topk_group=1,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                       "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    common.update(overrides)
    cfg = config_cls(**common)
    cfg._attn_implementation = "eager"
    return cfg


#: Projections whose outputs get outlier channels: the inputs of the dispatch (its norms, RoPE and FP8 scales are
#: what outliers stress). Outliers elsewhere (q_b_proj / kv_b_proj rows) would multiply in q.k and make every
#: softmax one-hot, so one swapped top-k key would flip a token's output: not a property of real checkpoints.
OUTLIER_PROJECTIONS = ("q_a_proj", "kv_a_proj_with_mqa", "indexer.wk")


def randomize_weights(model: torch.nn.Module, seed: int, *, outlier_channels: int = 3, outlier_gain: float = 20.0):
    """Seeded weights for every parameter: linear weights N(0, fan_in^-1/2), the OUTLIER_PROJECTIONS with
    `outlier_channels` output channels `outlier_gain` times larger (activation outliers), norm weights
    1 + 0.25 N(0, 1), biases 0.1 N(0, 1), embeddings N(0, 1), router correction biases 0.01 N(0, 1).
    Values are rounded to bf16 (what a checkpoint holds). Deterministic for a given seed and model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = p.shape
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                v = 1.0 + 0.25 * torch.randn(shape, generator=gen)
            elif name.endswith(".bias") and "correction" not in name:
                v = 0.1 * torch.randn(shape, generator=gen)
            elif "correction_bias" in name:
                v = 0.01 * torch.randn(shape, generator=gen)
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=gen)
            elif p.dim() >= 2:
                fan_in = shape[-1]
                v = torch.randn(shape, generator=gen) * fan_in ** -0.5
                if p.dim() == 2 and any(f"{k}.weight" in name for k in OUTLIER_PROJECTIONS):
                    idx = torch.randperm(shape[0], generator=gen)[:outlier_channels]
                    v[idx] *= outlier_gain
            else:
                v = torch.randn(shape, generator=gen) * 0.1
            p.copy_(v.to(torch.bfloat16).to(p.dtype))


def build_hf_model(config, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device=None):
    """The HF causal LM (GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM) of `config` with randomize_weights(seed),
    in `dtype` on `device`, eval mode, eager attention (HF's own DSA indexer and masked attention)."""
    _, lm_cls = hf_modules(config.model_type)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = lm_cls(config)
    randomize_weights(model, seed)
    model = model.to(dtype=dtype)
    if device is not None:
        model = model.to(device)
    model.config._attn_implementation = "eager"
    return model.eval()


@torch.no_grad()
def hf_reference_forward(model, ids: torch.Tensor, inject: dict | None = None):
    """HF's own eager forward of one sequence ids int64 [N] (a model whose attention is HF's, i.e. not wrapped
    by a PcpModel). Returns (logits float32 [N, vocab], hidden states [float32 [N, hidden]] as HF's
    output_hidden_states gives them, {layer: HF's own top-k key positions int64 [N, topk]}), all on the CPU.
    inject: {layer: key positions [N, topk] (-1 tail)} that HF's indexer returns instead of its own selection,
    so that HF attends over the same keys as the run they came from (its own selection is still reported);
    a -1 entry becomes the query's own position, which every causal selection contains anyway."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if getattr(layer.self_attn, "indexer", None) is None:
            continue

        def hook(mod, args, out, i=i):
            seen[i] = out[0].cpu().long()
            if inject is None:
                return None
            p = inject[i].to(out.device)
            own = torch.arange(p.shape[0], device=out.device)[:, None].expand_as(p)
            return torch.where(p >= 0, p, own)[None].to(out.dtype)

        hooks.append(layer.self_attn.indexer.register_forward_hook(hook))
    try:
        device = next(model.parameters()).device
        out = model(ids.to(device)[None], output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].float().cpu(), [h[0].float().cpu() for h in out.hidden_states], seen
