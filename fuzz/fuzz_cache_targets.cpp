// libFuzzer target: the C++ validation behind pcpkv_torch's table constructors (make_cache_targets,
// the dispatch's target tables). The Python-side checks in python/csrc/checks.cpp read torch tensors
// (sizes, strides, dtypes) and then call these pcpkv checks; torch is not linked here, so the target feeds
// the same values (format strings, k_scale, geometry a tensor's sizes/strides would give) straight in.
// Property: a target that passes validation addresses every slot inside its geometry's bytes() without
// overflow.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "pcpkv/publish/validate.h"
#include "pcpkv/publish/dispatch.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/layout.h"

namespace {

struct Fixed {
  int64_t mla_num_blocks;
  int32_t mla_block_size;
  int64_t mla_row_stride;
  int64_t mla_block_stride;
  int64_t idx_num_blocks;
  int32_t idx_block_size;
  int64_t idx_block_stride;
  float k_scale;
  uint8_t has_indexer;
};

void check_addresses(const pcpkv::CacheTarget& t, const pcpkv::CacheFormat& fmt) {
  const int64_t n = t.mla.num_slots();
  if (n > 0) {
    const int64_t end = t.mla.row_offset(n - 1) + pcpkv::mla_row_bytes(fmt.kv_format);
    if (end > t.mla.bytes()) __builtin_trap();
  }
  if (!fmt.has_indexer) return;
  const int64_t m = t.index.num_slots();
  if (m > 0) {
    if (t.index.data_offset(m - 1) + pcpkv::kIndexHeadDim > t.index.bytes()) __builtin_trap();
    if (t.index.scale_offset(m - 1) + 4 > t.index.bytes()) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixed x{};
  if (size < sizeof(x)) return 0;
  std::memcpy(&x, data, sizeof(x));
  // The rest: "kv_format\0ds_mla_scale" as the Python strings.
  const std::string rest(reinterpret_cast<const char*>(data + sizeof(x)), size - sizeof(x));
  const size_t nul = rest.find('\0');
  const std::string kv = rest.substr(0, nul);
  const std::string scale = nul == std::string::npos ? "pow2" : rest.substr(nul + 1);
  static uint8_t fake[1];  // validation never dereferences the bases
  try {
    pcpkv::CacheFormat fmt;
    fmt.kv_format = pcpkv::parse_kv_format(kv, "kv_format");
    fmt.ds_mla_scale = pcpkv::parse_ds_mla_scale(scale, "ds_mla_scale");
    fmt.k_scale = x.k_scale;
    fmt.has_indexer = (x.has_indexer & 1) != 0;
    pcpkv::validate_cache_format(fmt);
    pcpkv::CacheTarget t;
    t.mla_base = fake;
    t.mla = {x.mla_num_blocks, x.mla_block_size, x.mla_row_stride, x.mla_block_stride};
    t.index_base = fake;
    t.index = {x.idx_num_blocks, x.idx_block_size, x.idx_block_stride};
    pcpkv::validate_cache_target(t, fmt, "targets[0]");
    check_addresses(t, fmt);
  } catch (const pcpkv::Error&) {
  }
  return 0;
}
