// The built-in presets of SPEC section 1 (the values configs/<name>.json carries), for the HF config reader: a config
// overrides the preset its model_type names (hf_config.cpp).
#pragma once

#include <string>

#include "pcpkv/core/model.h"

namespace pcpkv {

/// The built-in values of preset `name`; throws pcpkv::Error naming --model for an unknown name.
ModelConfig builtin_preset(const std::string& name);

/// The preset an HF model_type stands for ("glm_moe_dsa" -> "glm-5"), "" when none.
std::string preset_for_model_type(const std::string& model_type);

}  // namespace pcpkv
