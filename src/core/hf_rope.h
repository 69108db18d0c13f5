// The RoPE keys of an HF config.json (rope_theta, rope_scaling / rope_parameters and their YaRN sub-keys), read as
// HF transformers 5 and vLLM's DeepSeek YaRN read them, for the HF config reader (hf_config.cpp).
#pragma once

#include <set>
#include <string>

#include "core/hf_json.h"
#include "pcpkv/core/model.h"

namespace pcpkv::hf_json {

/// Reads the RoPE keys of `j` into m.rope, adding the keys it looked at to `used` and what it kept or ignored to
/// `notes`; base_name: the preset whose values stay where a key is missing. Throws pcpkv::Error naming the key for a
/// value pcpkv cannot serve, and in strict mode for an unknown RoPE key.
void apply_rope(const json& j, ModelConfig& m, Reader& r, const std::string& origin, std::set<std::string>& used,
                const JsonPaths& paths, const std::string& base_name, ConfigNotes& notes, bool strict);

}  // namespace pcpkv::hf_json
