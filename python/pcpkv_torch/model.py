"""What the ops need to know about a DSA/MLA model (SPEC section 1), read from a HF config. Pure Python.

A HF ``config.json`` (a dict) or a ``transformers`` config object both work. The C++ loader of the library
(``pcpkv::load_hf_config``, src/core/model.cpp) is the reference for the CLI; this module reads the same keys
for the fields the torch ops take (eps values, RoPE, rope styles, which layers have an indexer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["RopeSpec", "ModelSpec", "CacheFormat", "MLA_ROW_BYTES", "transport_row_bytes"]

#: Bytes of one MLA cache row per format (SPEC section 3).
MLA_ROW_BYTES = {"bf16": 1152, "fp8": 576, "fp8_ds_mla": 656}


def transport_row_bytes(kv_format: str, has_indexer: bool = True) -> int:
    """Bytes of one transport row (SPEC section 3): 720 (fp8), 800 (fp8_ds_mla), 1296 (bf16) with an indexer;
    the MLA row alone (576 / 656 / 1152) without. Raises ValueError on an unknown format."""
    if kv_format not in MLA_ROW_BYTES:
        raise ValueError(f"kv_format = {kv_format!r}; expected one of {sorted(MLA_ROW_BYTES)}")
    mla = MLA_ROW_BYTES[kv_format]
    return mla + 128 + 4 + 12 if has_indexer else mla


@dataclass(frozen=True)
class CacheFormat:
    """What one layer writes (pcpkv::CacheFormat): MLA row format, fp8_ds_mla tile-scale rule, the static
    fp8 scale, and whether the layer has an indexer (False: a GLM "shared" layer that writes no indexer K)."""

    kv_format: str = "fp8_ds_mla"  # "bf16" | "fp8" | "fp8_ds_mla"
    ds_mla_scale: str = "pow2"  # "pow2" (current vLLM / FlashMLA) | "raw" (older vLLM writers)
    k_scale: float = 1.0  # fp8 only: x / k_scale, > 0 and finite
    has_indexer: bool = True

    def __post_init__(self):
        if self.kv_format not in MLA_ROW_BYTES:
            raise ValueError(f"kv_format = {self.kv_format!r}; expected one of {sorted(MLA_ROW_BYTES)}")
        if self.ds_mla_scale not in ("pow2", "raw"):
            raise ValueError(f"ds_mla_scale = {self.ds_mla_scale!r}; expected 'pow2' or 'raw'")
        if not (self.k_scale > 0 and self.k_scale != float("inf")):
            raise ValueError(f"k_scale = {self.k_scale} must be finite and > 0")

    @property
    def mla_row_bytes(self) -> int:
        return MLA_ROW_BYTES[self.kv_format]

    @property
    def row_bytes(self) -> int:
        """Transport row bytes (SPEC section 3)."""
        return transport_row_bytes(self.kv_format, self.has_indexer)


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of the 64 rotary dims (SPEC section 1). scaling: "default" or "deepseek_yarn"."""

    scaling: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    @staticmethod
    def from_hf(config: Any) -> "RopeSpec":
        """Reads ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older configs).
        Raises ValueError for a rope type pcpkv does not implement (only default and YaRN)."""
        params = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
        params = dict(params)
        theta = params.get("rope_theta", _get(config, "rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type == "default":
            return RopeSpec("default", float(theta))
        if rope_type not in ("yarn", "deepseek_yarn"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default or yarn)")
        return RopeSpec(
            "deepseek_yarn",
            float(theta),
            float(params.get("factor", 1.0)),
            int(params.get("original_max_position_embeddings", 4096)),
            float(params.get("beta_fast", 32.0)),
            float(params.get("beta_slow", 1.0)),
            float(params.get("mscale", 1.0)),
            float(params.get("mscale_all_dim", 1.0)),
        )


@dataclass(frozen=True)
class ModelSpec:
    """The per-layer constants of the dispatch (SPEC section 2) for one model."""

    model_type: str
    q_lora_rank: int
    rms_norm_eps: float  # q_a_layernorm and kv_a_layernorm
    rope: RopeSpec
    index_norm_eps: float = 1e-6  # indexer k_norm (LayerNorm)
    mla_rope_interleave: bool = True
    indexer_rope_interleave: bool = False  # False: NeoX half split (i, i+32)
    indexer_hadamard: bool = False
    index_topk: int = 2048
    num_hidden_layers: int = 0
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 0
    indexer_types: tuple = field(default_factory=tuple)
    max_position_embeddings: int = 0  # 0: unknown; make_plan(..., max_position_embeddings=) refuses past it

    @staticmethod
    def from_hf_config(config: Any) -> "ModelSpec":
        """From a HF config (dict or transformers config). The indexer RoPE style is the config's
        ``indexer_rope_interleave`` when present, else the model type's (glm_moe_dsa: interleaved, as HF's
        GlmMoeDsaIndexer; deepseek_v32: NeoX, as HF's DeepseekV32Indexer). Raises ValueError when
        kv_lora_rank != 512, qk_rope_head_dim != 64 or index_head_dim != 128 (the cache layouts fix them)."""
        model_type = _get(config, "model_type", "")
        for key, want in (("kv_lora_rank", 512), ("qk_rope_head_dim", 64), ("index_head_dim", 128)):
            got = _get(config, key, want)
            if got != want:
                raise ValueError(f"{key} = {got}; pcpkv's cache layouts need {want}")
        interleave = _get(config, "indexer_rope_interleave")
        if interleave is None:
            interleave = model_type == "glm_moe_dsa"
        types = _get(config, "indexer_types") or ()
        return ModelSpec(
            model_type=model_type,
            q_lora_rank=int(_get(config, "q_lora_rank")),
            rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
            rope=RopeSpec.from_hf(config),
            mla_rope_interleave=bool(_get(config, "rope_interleave", True)),
            indexer_rope_interleave=bool(interleave),
            index_topk=int(_get(config, "index_topk", 2048)),
            num_hidden_layers=int(_get(config, "num_hidden_layers", 0)),
            index_topk_freq=int(_get(config, "index_topk_freq", 1) or 1),
            index_skip_topk_offset=int(_get(config, "index_skip_topk_offset", 0) or 0),
            indexer_types=tuple(types),
            max_position_embeddings=int(_get(config, "max_position_embeddings", 0) or 0),
        )

    def layer_has_indexer(self, layer_idx: int) -> bool:
        """Whether layer layer_idx runs its own indexer and writes indexer K (GLM IndexShare, model.h)."""
        if self.indexer_types:
            return self.indexer_types[layer_idx] == "full"
        if self.index_topk_freq <= 1:
            return True
        # HF / vLLM IndexShare schedule (as src/core/model.cpp): full iff max(l - offset + 1, 0) % freq == 0.
        return max(layer_idx - self.index_skip_topk_offset + 1, 0) % self.index_topk_freq == 0

    def dispatch_kwargs(self) -> dict:
        """Keyword arguments of pcpkv_torch.dispatch that come from the model."""
        return dict(
            q_eps=self.rms_norm_eps,
            kv_eps=self.rms_norm_eps,
            index_eps=self.index_norm_eps,
            mla_rope_interleaved=self.mla_rope_interleave,
            index_rope_interleaved=self.indexer_rope_interleave,
            index_hadamard=self.indexer_hadamard,
        )
