"""Whole-model PCP prefill: HF DeepSeek-V3.2 / GLM-5 models whose attention runs under PCP through pcpkv.

  from pcpkv_torch.models import PcpModel, StepRequest, build_hf_model, small_config
  model = build_hf_model(small_config("glm-5"), seed=0)
  pcp = PcpModel(model, pcp_world=4, num_blocks=64, block_size=16, transport="direct")
  logits, _ = pcp.step([StepRequest("a", token_ids)])
Needs transformers >= 5.17 (GlmMoeDsa*, DeepseekV32*) for build_hf_model; PcpModel takes any such model.
"""

from .attention import PcpAttention, PcpRuntime, apply_rope, chunked
from .batch import BlockTables, StepBatch, StepRequest
from .hf import MODEL_TYPES, build_hf_model, hf_modules, hf_reference_forward, randomize_weights, small_config
from .runner import PcpModel
from .dist_world import DistPcpModel, DistPcpWorld
from .world import TRANSPORTS, LocalInputs, PcpWorld

__all__ = ["PcpAttention", "PcpRuntime", "apply_rope", "chunked", "BlockTables", "StepBatch", "StepRequest",
           "MODEL_TYPES", "build_hf_model", "hf_modules", "hf_reference_forward", "randomize_weights", "small_config", "PcpModel", "DistPcpModel", "DistPcpWorld",
           "TRANSPORTS", "LocalInputs", "PcpWorld"]
