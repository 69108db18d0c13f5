// libFuzzer target: the --inputs loader's batch reader (read_inputs_batch: requests, slot_mapping,
// block_tables, metadata) on a safetensors file.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs_io.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const pcpkv::fuzz::MemFile f(data, size);
  try {
    const pcpkv::InputsBatch b = pcpkv::read_inputs_batch(f.path());
    int64_t total = 0;
    for (const auto& r : b.requests) total += r.num_new_tokens;
    if (!b.requests.empty() && total != b.num_tokens) __builtin_trap();  // the reader promises this sum
  } catch (const pcpkv::Error&) {
  }
  return 0;
}
