// The first key a JSON text repeats inside one object. nlohmann keeps the last of two equal keys without a word,
// so every JSON file pcpkv reads (a --config, a safetensors header) is refused with this instead.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace pcpkv {

struct DuplicateKey {
  std::string key;   // the repeated key ("q_lora_rank")
  std::string path;  // its key path ("rope_scaling.factor", "layers[2].x"); the key itself at the top level
  size_t depth = 0;  // 1: a key of the top-level object
};

/// The first key that appears twice in one object of `text`, or nullopt when there is none (or the text does not
/// parse: the caller's parse names that). A SAX pass: nlohmann's parse callback would also see every key, but its
/// object handling is quadratic in the number of keys (a safetensors header names every tensor).
std::optional<DuplicateKey> first_duplicate_key(const std::string& text);

}  // namespace pcpkv
