// pcpkv/consumers/lse_merge.h: merge of partial attention outputs by their log-sum-exp (SPEC section 6), for DCP
// shards or split work.
//
// Per (token, head), over shards n whose lse_n is finite or -inf (NaN and +inf count as -inf):
//   m   = max_n lse_n;   L = ln(sum_n exp(lse_n - m)) + m;   out = sum_n exp(lse_n - L) * out_n
// A shard with lse -inf contributes nothing (its out_n is not read, so NaN there does no harm); when
// every shard is empty: out = 0, lse = -inf.
// CPU reference: fp64 math, rounded once to fp32. CUDA: fp32, shards summed in index order; bound:
//   |lse - ref| <= 4u (|ref| + max_n |lse_n| + 1) + (S + 8) u
//   |out - ref| <= (8u (|L| + max_n |lse_n| + 1) + (2S + 16) u) * sum_n w_n |out_n| + 2u |ref| + 1e-30
// with u = 2^-24, S shards, w_n = exp(lse_n - L) (LseMergeBound below).
#pragma once

#include <cstdint>

namespace pcpkv {

struct LseMergeParams {
  int32_t num_shards = 0;       // S >= 1
  int64_t num_rows = 0;         // R = tokens * heads
  int32_t head_dim = 512;       // D >= 1
  const float* outs = nullptr;  // [S, R, D] partial outputs
  const float* lses = nullptr;  // [S, R] partial LSEs (natural log)
  float* out = nullptr;         // [R, D]
  float* lse = nullptr;         // [R]
};

/// Throws pcpkv::Error naming the field (num_shards, num_rows, head_dim, a null pointer).
void validate_lse_merge(const LseMergeParams& p);

/// CPU reference (host pointers).
void lse_merge_cpu(const LseMergeParams& p);

struct LseMergeBound {
  /// Bounds of row r's values; inputs are the host copies of the merge's inputs.
  static double lse_bound(const LseMergeParams& in, int64_t row, double ref);
  static double out_bound(const LseMergeParams& in, int64_t row, int32_t d, double ref);
};

namespace cuda {
/// CUDA kernel (device pointers, stream a cudaStream_t).
void lse_merge(const LseMergeParams& p, void* stream);
}  // namespace cuda

}  // namespace pcpkv
