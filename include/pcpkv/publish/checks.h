// pcpkv/publish/checks.h: the checks that prove a published cache right.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/publish/backend.h"

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
/// inputs (RMSNorm, RoPE, LayerNorm in double), for every slot the plan writes. Per value:
///   E4M3 values (scale s = tile scale, k_scale or indexer scale):
///     |dequant - exact| <= 2^-4 * |exact| + 2^-10 * s    (3 mantissa bits; half the subnormal step 2^-9 s)
///     plus 2^-8 * |exact| when the path rounds to bf16 first (collect);
///   bf16 values (k_pe of fp8_ds_mla rows, all of bf16 rows; rounding to bf16 first changes nothing):
///     |dequant - exact| <= 2^-8 * |exact| + 2^-16 * amax  (amax = max |exact| of the token's 512 kv_c / 64 k_pe;
///     the absolute term covers fp32 RoPE cancellation, which a purely relative bound would flag).
/// Saturated values (|exact| > 448 * s, static fp8 only) are counted apart and not against the bound.
/// Scales are checked too (a wrong scale widens the bound): power-of-two scales (ds_mla pow2, indexer UE8M0)
/// must lie in [l, 2l] for l = the SPEC lower bound from the exact amax (max(amax/448, 1e-4), resp.
/// max(amax, 1e-4)/448), raw scales within 2^-7 of max(amax/448, FLT_MIN), both widened by 2^-7; a scale
/// outside counts as one value over the bound. Why the bound holds: src/publish/checks.cpp.
struct Fp8Report {
  int64_t num_values = 0;
  int64_t num_over_bound = 0;
  int64_t num_saturated = 0;
  int64_t num_flushed = 0;  // static fp8: nonzero values below 2^-10 * k_scale, which encode as 0 (still checked)
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
