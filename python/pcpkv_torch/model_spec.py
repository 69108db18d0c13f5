"""The model spec: what the ops need to know about a DSA/MLA model (SPEC section 1), read from a HF config. Pure
Python. (Its former name pcpkv_torch.model is this module too.)

A HF ``config.json`` (a dict) or a ``transformers`` config object both work. The C++ loader of the library
(``pcpkv::load_hf_config``, src/core/hf_config.cpp) is the reference for the CLI; this module reads the same keys
for the fields the torch ops take (eps values, RoPE, rope styles, which layers have an indexer).
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["RopeSpec", "ModelSpec", "CacheFormat", "MLA_ROW_BYTES", "transport_row_bytes"]

#: Bytes of one MLA cache row per format (SPEC section 3).
MLA_ROW_BYTES = {"bf16": 1152, "fp8": 576, "fp8_ds_mla": 656}

#: The largest max_position_embeddings pcpkv accepts: the C++ loader reads the key into the int64
#: pcpkv::ModelConfig::max_position_embeddings (include/pcpkv/core/model.h), and its Reader (src/core/hf_config.cpp)
#: refuses a value outside the int64 range before converting it; it refuses values < 1 as well.
MAX_POSITION_EMBEDDINGS = 2 ** 63 - 1


#: The normal float32 range [FLT_MIN, FLT_MAX] (pcpkv's kernels take their scales and eps as float32).
FLT_MIN = 2.0 ** -126
FLT_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127


def scale_problem(value) -> str | None:
    """Why `value` cannot be a scale the kernels divide by (fp8's k_scale: the cache stores x / k_scale), or None:
    it must be a number whose float32 is finite, positive and normal. 0, negatives, nan and inf are refused, and
    subnormals (1e-45): x / 2^-149 is inf for every |x| > 2^-21, and flush-to-zero arithmetic reads it as 0.
    The callers name the argument and its value. The same rule and text as C++'s pcpkv::scale_problem
    (pcpkv/core/layout.h), which the raw ops check."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "must be a number"
    if FLT_MIN <= value <= FLT_MAX:  # nan compares false
        return None
    return ("must be a finite, positive, normal float32 (in [2^-126, 3.4e38]; 0, negatives, subnormals such as "
            "1e-45, nan and inf are refused)")


def transport_row_bytes(kv_format: str, has_indexer: bool = True) -> int:
    """Bytes of one transport row (SPEC section 3): 720 (fp8), 800 (fp8_ds_mla), 1296 (bf16) with an indexer;
    the MLA row alone (576 / 656 / 1152) without. Raises ValueError on an unknown format."""
    if not isinstance(kv_format, str) or kv_format not in MLA_ROW_BYTES:  # a list was a TypeError (unhashable)
        raise ValueError(f"kv_format = {kv_format!r}; expected one of {sorted(MLA_ROW_BYTES)}")
    if not isinstance(has_indexer, bool):  # 'no' is truthy: it would have meant True (as CacheFormat refuses it)
        raise ValueError(f"has_indexer = {has_indexer!r} must be True or False")
    mla = MLA_ROW_BYTES[kv_format]
    return mla + 128 + 4 + 12 if has_indexer else mla


@dataclass(frozen=True)
class CacheFormat:
    """What one layer writes (pcpkv::CacheFormat): MLA row format, fp8_ds_mla tile-scale rule, the static
    fp8 scale, and whether the layer has an indexer (False: a GLM "shared" layer that writes no indexer K)."""

    kv_format: str = "fp8_ds_mla"  # "bf16" | "fp8" | "fp8_ds_mla"
    ds_mla_scale: str = "pow2"  # "pow2" (current vLLM / FlashMLA) | "raw" (older vLLM writers)
    k_scale: float = 1.0  # fp8 only: x / k_scale, a finite positive normal float32 (scale_problem)
    has_indexer: bool = True

    def __post_init__(self):
        if not isinstance(self.kv_format, str) or self.kv_format not in MLA_ROW_BYTES:
            raise ValueError(f"kv_format = {self.kv_format!r}; expected one of {sorted(MLA_ROW_BYTES)}")
        if self.ds_mla_scale not in ("pow2", "raw"):
            raise ValueError(f"ds_mla_scale = {self.ds_mla_scale!r}; expected 'pow2' or 'raw'")
        if why := scale_problem(self.k_scale):
            raise ValueError(f"k_scale = {self.k_scale!r} {why}")
        if not isinstance(self.has_indexer, bool):  # 'no' is truthy: it would have meant True
            raise ValueError(f"has_indexer = {self.has_indexer!r} must be True or False")

    @property
    def mla_row_bytes(self) -> int:
        return MLA_ROW_BYTES[self.kv_format]

    @property
    def row_bytes(self) -> int:
        """Transport row bytes (SPEC section 3)."""
        return transport_row_bytes(self.kv_format, self.has_indexer)


def written_fields(fmt: CacheFormat) -> dict:
    """The fields of fmt that decide the cache bytes a publication writes: kv_format and has_indexer, the tile-scale
    rule of fp8_ds_mla and the static scale of fp8 (no other format reads them). Two formats of equal written_fields
    write the same bytes: the rule by which an op compares the format it is given with the one its caches were laid
    out for (tables.check_targets)."""
    out = dict(kv_format=fmt.kv_format, has_indexer=fmt.has_indexer)
    if fmt.kv_format == "fp8_ds_mla":
        out["ds_mla_scale"] = fmt.ds_mla_scale
    if fmt.kv_format == "fp8":
        out["k_scale"] = fmt.k_scale
    return out


def check_cache_format(fmt, where: str) -> None:
    """ValueError naming `where` and the value when fmt is not a CacheFormat (a format name such as "fp8", or None,
    raised AttributeError in the op that read fmt.kv_format)."""
    if not isinstance(fmt, CacheFormat):
        raise ValueError(f"{where}: fmt = {fmt!r} must be a CacheFormat (e.g. CacheFormat({fmt!r}) for a format name)"
                         if isinstance(fmt, str) else f"{where}: fmt = {fmt!r} must be a CacheFormat")


def q_lora_rank_problem(q_lora_rank: int) -> str | None:
    """Why q_lora_rank (the width of q_c) cannot be the dispatch's, or None: DispatchParams takes a multiple of 8
    in [8, 4096] (pcpkv/publish/dispatch.h). The callers name the argument."""
    return None if 8 <= q_lora_rank <= 4096 and q_lora_rank % 8 == 0 else "must be a multiple of 8 in [8, 4096]"


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


_REQUIRED = object()


def _typed(value: Any, name: str, kind: type, default: Any = _REQUIRED) -> Any:
    """value checked to be of `kind` (int, float, bool, str); `default` when it is None (JSON null or
    absent). Raises ValueError naming `name` and the value when it is required and missing, or mistyped
    (int() / float() would raise TypeError on a list, accept "2048" or truncate 2048.5)."""
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{name} is missing from the HF config; pcpkv needs it")
        return default
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} = {value!r} must be true or false")
        return value
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} = {value!r} must be a string")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} = {value!r} must be a{'n integer' if kind is int else ' number'}")
    if not math.isfinite(value):
        raise ValueError(f"{name} = {value!r} must be finite")
    if kind is int:
        if value != int(value):
            raise ValueError(f"{name} = {value!r} must be an integer")
        return int(value)
    return float(value)


def _read(config: Any, key: str, kind: type, default: Any = _REQUIRED, *, where: str = "") -> Any:
    """config[key] (a dict key or an attribute) as `kind`, see _typed; `where` prefixes the key in messages."""
    return _typed(_get(config, key), where + key, kind, default)


def _check_range(name: str, value, lo, hi, *, lo_open: bool = False, hi_open: bool = False):
    """ValueError naming `name` unless value lies in the interval lo..hi (open or closed at each end)."""
    if not ((value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)):
        raise ValueError(f"{name} = {value!r} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}")


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of the 64 rotary dims (SPEC section 1). scaling: "default" or "deepseek_yarn".

    Raises ValueError naming the field (with its HF key) on a value pcpkv::validate_rope refuses: theta
    (rope_theta) in (1, 1e12]; with YaRN factor in [1, 1e4], original_max_position_embeddings in [1, 2^40],
    beta_fast >= beta_slow in (0, 1e4], mscale and mscale_all_dim in [0, 1e3]. (theta <= 0 gave NaN tables.)"""

    scaling: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self):
        if self.scaling not in ("default", "deepseek_yarn"):
            raise ValueError(f"RopeSpec: scaling = {self.scaling!r}; expected 'default' or 'deepseek_yarn'")
        _check_range("RopeSpec: theta (rope_theta)", _typed(self.theta, "RopeSpec: theta (rope_theta)", float),
                     1.0, 1e12, lo_open=True)
        if self.scaling != "deepseek_yarn":
            return
        ranges = (("factor", float, 1.0, 1e4, False), ("original_max_position_embeddings", int, 1, 1 << 40, False),
                  ("beta_fast", float, 0.0, 1e4, True), ("beta_slow", float, 0.0, 1e4, True),
                  ("mscale", float, 0.0, 1e3, False), ("mscale_all_dim", float, 0.0, 1e3, False))
        for key, kind, lo, hi, lo_open in ranges:
            _check_range(f"RopeSpec: {key}", _typed(getattr(self, key), f"RopeSpec: {key}", kind), lo, hi,
                         lo_open=lo_open)
        if self.beta_fast < self.beta_slow:
            raise ValueError(f"RopeSpec: beta_fast = {self.beta_fast!r} is less than beta_slow = {self.beta_slow!r}: "
                             "YaRN needs beta_fast >= beta_slow (swapped keys?)")

    @staticmethod
    def from_hf(config: Any) -> "RopeSpec":
        """Reads ``rope_scaling`` when it is a non-empty dict, else ``rope_parameters`` (transformers 5's rule), with
        ``rope_theta`` from that dict or the top level.
        Raises ValueError for a rope type pcpkv does not implement (only default and YaRN), naming the key for a
        YaRN dict without factor or original_max_position_embeddings (HF transformers requires both), and naming the
        key and value for a mistyped or out-of-range one."""
        scaling, parameters = _get(config, "rope_scaling"), _get(config, "rope_parameters")
        # HF transformers 5 (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict): rope_parameters = rope_scaling
        # or rope_parameters; a transformers config object returns one dict for both names.
        if scaling and scaling is not parameters:
            where, params = "rope_scaling", scaling
        else:
            where = "rope_parameters" if parameters else "rope_scaling"
            params = parameters or scaling or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"{where} = {params!r} must be a dict")
        where += "."
        top_theta = _read(config, "rope_theta", float, None)
        if params.get("rope_theta") is not None:
            theta = _typed(params["rope_theta"], where + "rope_theta", float)
            if top_theta is not None and top_theta != theta:
                # as pcpkv::load_hf_config's note (src/core/hf_rope.cpp apply_rope), which the CLI prints: HF
                # transformers 5 reads the theta of rope_parameters too, the top-level key is dead text
                warnings.warn(f"top-level 'rope_theta' = {_get(config, 'rope_theta')!r} is shadowed by "
                              f"'{where}rope_theta' = {params['rope_theta']!r}: using {params['rope_theta']!r}",
                              stacklevel=3)
        else:
            theta = 10000.0 if top_theta is None else top_theta
        rope_type = _typed(params.get("rope_type", params.get("type")), where + "rope_type", str, "default")
        if rope_type == "default":
            return RopeSpec("default", theta)
        if rope_type not in ("yarn", "deepseek_yarn"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default or yarn)")
        # factor and original_max_position_embeddings are required, as HF transformers' YaRN validation requires
        # them (pcpkv took 1.0 and 4096 silently: another table than the model's)
        return RopeSpec(
            "deepseek_yarn",
            theta,
            _read(params, "factor", float, where=where),
            _read(params, "original_max_position_embeddings", int, where=where),
            _read(params, "beta_fast", float, 32.0, where=where),
            _read(params, "beta_slow", float, 1.0, where=where),
            _read(params, "mscale", float, 1.0, where=where),
            _read(params, "mscale_all_dim", float, 1.0, where=where),
        )


def _max_positions(config: Any) -> int:
    """max_position_embeddings of a HF config: 0 (unknown) when absent or null, else an integer in
    [1, MAX_POSITION_EMBEDDINGS] (ValueError naming the value: 'abc', [1], inf, 2.5, True, -5, 10**30 passed)."""
    value = _read(config, "max_position_embeddings", int, 0)
    if _get(config, "max_position_embeddings") is not None and not 1 <= value <= MAX_POSITION_EMBEDDINGS:
        raise ValueError(f"max_position_embeddings = {_get(config, 'max_position_embeddings')!r} must be in "
                         f"[1, 2^63 - 1] (the C++ loader reads it into pcpkv::ModelConfig's int64 and refuses "
                         f"values < 1)")
    return value


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

    def __post_init__(self):
        # A list of the wrong length raised a bare IndexError in layer_has_indexer (or gave the wrong layers).
        if self.indexer_types and self.num_hidden_layers >= 1 and len(self.indexer_types) != self.num_hidden_layers:
            raise ValueError(f"indexer_types has {len(self.indexer_types)} entries but num_hidden_layers = "
                             f"{self.num_hidden_layers}: expected one 'full' / 'shared' per layer")

    @staticmethod
    def from_hf_config(config: Any) -> "ModelSpec":
        """From a HF config (dict or transformers config). The indexer RoPE style is the config's
        ``indexer_rope_interleave`` when present, else the model type's (glm_moe_dsa: interleaved, as HF's
        GlmMoeDsaIndexer; deepseek_v32: NeoX, as HF's DeepseekV32Indexer). Absent (or null) optional keys take
        the defaults of the fields below (rms_norm_eps: 1e-5 for glm_moe_dsa, as GlmMoeDsaConfig); q_lora_rank is
        required.

        Raises ValueError naming the key and its value when q_lora_rank is missing, a key has the wrong type
        (a string, a list, a fractional integer, a non-finite number), a value is out of range (q_lora_rank a
        multiple of 8 in [8, 4096] (the dispatch's q_c), rms_norm_eps / index_norm_eps in (0, 1), index_topk,
        num_hidden_layers, index_topk_freq >= 1, index_skip_topk_offset >= 0, RopeSpec's ranges), or
        kv_lora_rank != 512, qk_rope_head_dim != 64 or index_head_dim != 128 (the cache layouts fix them), an
        indexer_types list whose length is not num_hidden_layers, or max_position_embeddings not an integer in
        [1, 2^63 - 1] (MAX_POSITION_EMBEDDINGS, the C++ loader's bound); absent or null it is 0 (unknown).
        A top-level rope_theta that rope_parameters / rope_scaling overrides with another value gives a
        UserWarning naming both (the C++ loader's note)."""
        if not isinstance(config, Mapping) and not hasattr(config, "__dict__"):
            raise ValueError(f"config = {config!r}: expected a HF config dict or a transformers config object")
        model_type = _read(config, "model_type", str, "")
        for key, want in (("kv_lora_rank", 512), ("qk_rope_head_dim", 64), ("index_head_dim", 128)):
            got = _read(config, key, int, want)
            if got != want:
                raise ValueError(f"{key} = {got}; pcpkv's cache layouts need {want}")
        q_lora_rank = _read(config, "q_lora_rank", int)
        if why := q_lora_rank_problem(q_lora_rank):
            raise ValueError(f"q_lora_rank = {q_lora_rank} {why}")
        eps = {}
        # Absent: the default of the model type's transformers config class (GlmMoeDsaConfig 1e-5, DeepseekV32Config
        # 1e-6; neither has index_norm_eps), which the C++ loader's presets hold too.
        for key, default in (("rms_norm_eps", 1e-5 if model_type == "glm_moe_dsa" else 1e-6), ("index_norm_eps", 1e-6)):
            eps[key] = _read(config, key, float, default)
            _check_range(key, eps[key], 0.0, 1.0, lo_open=True, hi_open=True)
        ints = {}
        for key, default, lo in (("index_topk", 2048, 1), ("num_hidden_layers", 0, 1), ("index_topk_freq", 1, 1),
                                 ("index_skip_topk_offset", 0, 0)):
            ints[key] = _read(config, key, int, default)
            if _get(config, key) is not None and ints[key] < lo:
                raise ValueError(f"{key} = {ints[key]} must be >= {lo}")
        interleave = _read(config, "indexer_rope_interleave", bool, model_type == "glm_moe_dsa")
        types = _get(config, "indexer_types") or ()
        if isinstance(types, str) or not isinstance(types, (list, tuple)):
            raise ValueError(f"indexer_types = {types!r} must be a list of 'full' / 'shared'")
        for i, t in enumerate(types):
            if t not in ("full", "shared"):
                raise ValueError(f"indexer_types[{i}] = {t!r} must be 'full' or 'shared'")
        return ModelSpec(
            model_type=model_type,
            q_lora_rank=q_lora_rank,
            rms_norm_eps=eps["rms_norm_eps"],
            rope=RopeSpec.from_hf(config),
            index_norm_eps=eps["index_norm_eps"],
            mla_rope_interleave=_read(config, "rope_interleave", bool, True),
            indexer_rope_interleave=interleave,
            indexer_hadamard=_read(config, "indexer_hadamard", bool, False),
            index_topk=ints["index_topk"],
            num_hidden_layers=ints["num_hidden_layers"],
            index_topk_freq=ints["index_topk_freq"],
            index_skip_topk_offset=ints["index_skip_topk_offset"],
            indexer_types=tuple(types),
            max_position_embeddings=_max_positions(config),
        )

    def layer_has_indexer(self, layer_idx: int) -> bool:
        """Whether layer layer_idx runs its own indexer and writes indexer K (GLM IndexShare, model.h).
        Raises ValueError for a negative layer_idx or one without an indexer_types entry (not a bare IndexError)."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx = {layer_idx!r} must be an integer >= 0")
        if self.indexer_types:
            if layer_idx >= len(self.indexer_types):
                raise ValueError(f"layer_idx = {layer_idx} has no entry in indexer_types (size "
                                 f"{len(self.indexer_types)})")
            return self.indexer_types[layer_idx] == "full"
        if self.index_topk_freq <= 1:
            return True
        # HF / vLLM IndexShare schedule (as src/core/model_validate.cpp): full iff max(l - offset + 1, 0) % freq == 0.
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
