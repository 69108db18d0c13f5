// libFuzzer target: the safetensors reader (header parse, then every tensor read back).
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const pcpkv::fuzz::MemFile f(data, size);
  try {
    const pcpkv::SafetensorsReader r(f.path());
    for (const pcpkv::StTensorInfo& t : r.tensors()) {
      const auto bytes = r.read_bytes(t.name);
      if (static_cast<int64_t>(bytes.size()) != t.num_bytes()) __builtin_trap();
    }
  } catch (const pcpkv::Error&) {
  }
  return 0;
}
