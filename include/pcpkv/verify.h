// pcpkv/verify.h: the checks that prove a published cache right.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/backend.h"

namespace pcpkv {

/// Byte comparison of two buffers of equal size. first_diff = -1 when equal.
struct ByteDiff {
  int64_t num_diff = 0;
  int64_t first_diff = -1;
  bool equal() const { return num_diff == 0; }
};
ByteDiff compare_bytes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b);

/// Every byte of rank r's allocations not covered by a row the plan writes (guards, the base offset,
/// row and block padding, unwritten slots, the indexer cache of a layer without one) must equal
/// kGuardByte. Returns the number of bytes that do not, and a description of the first.
struct GuardReport {
  int64_t num_bad = 0;
  std::string first;
};
GuardReport check_untouched(const PublishResult& r, int32_t rank, const PcpPlan& plan, const CacheFormat& fmt);

/// FP8 bound check of rank r's cache against fp64 math of the SPEC section 2 formulas on the same
/// inputs (RMSNorm, RoPE, LayerNorm in double). Per value the bound is
///   |dequant - exact| <= 2^-4 * |exact| + 2^-10 * scale      (E4M3: 3 mantissa bits, subnormal step)
/// plus 2^-8 * |exact| when the path rounds to bf16 first (collect) and for bf16 values; saturated
/// values (|exact| > 448 * scale, static fp8 only) are counted apart and not against the bound.
struct Fp8Report {
  int64_t num_values = 0;
  int64_t num_over_bound = 0;
  int64_t num_saturated = 0;
  double max_abs_err = 0.0;
  double max_err_over_bound = 0.0;  // max |err| / bound (<= 1 passes)
  std::string worst;                // where the worst value lies
};
Fp8Report check_fp8_bound(const PublishResult& r, int32_t rank, const GlobalInputs& in, const PcpPlan& plan,
                          const ModelConfig& model, const CacheFormat& fmt, bool bf16_first);

/// Decoded cache contents of one slot (for tools and tests).
struct DecodedRow {
  float kv_c[512];
  float k_pe[64];
  float index_k[128];
  float tile_scales[4];
  float index_scale;
};
DecodedRow decode_slot(const uint8_t* mla_cache, const MlaCacheGeometry& mg, const uint8_t* index_cache,
                       const IndexerCacheGeometry& ig, const CacheFormat& fmt, int64_t slot);

}  // namespace pcpkv
