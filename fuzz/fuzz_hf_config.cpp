// libFuzzer target: the HF config.json loader (parse_hf_config, the text --config and presets go through).
// Bad input must end in pcpkv::Error; any other exception, crash, leak or sanitizer report is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // First byte picks the mode (base preset, strict), the rest is the JSON text.
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const char* base = (mode & 1) ? "glm-5" : "";
  try {
    pcpkv::ConfigNotes notes;
    const pcpkv::ModelConfig m = pcpkv::parse_hf_config(text, base, &notes, (mode & 2) != 0, "fuzz.json");
    m.validate();
  } catch (const pcpkv::Error&) {
  }
  return 0;
}
