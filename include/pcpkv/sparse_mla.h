// pcpkv/sparse_mla.h: sparse MLA attention over selected cache slots (SPEC section 6), absorbed form.
//
// For query token t, head h, valid selected slots j (indices[t, *] >= 0; -1 entries are skipped):
//   s_j   = softmax_scale * (q[t,h,0:512] . kv_c_j + q[t,h,512:576] . k_pe_j)
//   out   = sum_j exp(s_j - lse) * kv_c_j           [512]   (v = kv_c)
//   lse   = ln(sum_j exp(s_j))                       natural log, softmax scale included
// A query with no valid slot gives out = 0 and lse = -inf (so an LSE merge drops it). Duplicate slots
// count once per occurrence. Cache values are decoded exactly as pcpkv/device/consumers.h says.
//
// CPU reference: fp64 accumulation from the fp32 cache values and bf16 queries, rounded once to fp32.
// CUDA kernel: fp32 accumulation (fixed order per token: deterministic, independent of batch and grid).
// The CUDA kernel's error bound against the reference is SparseMlaBound (below), tested in tests/cuda.
#pragma once

#include <cstdint>
#include <vector>

#include "pcpkv/layout.h"

namespace pcpkv {

struct SparseMlaParams {
  int64_t num_tokens = 0;            // T
  int32_t num_heads = 0;             // H query heads (num_attention_heads), >= 1
  const uint16_t* q = nullptr;       // [T, H, 576] bf16: q_nope absorbed (512) | q_pe (64)
  const uint8_t* mla_cache = nullptr;// first byte of block 0 of the MLA cache
  MlaCacheGeometry geometry;
  CacheFormat fmt;                   // kv_format and k_scale (static fp8) are read
  const int32_t* indices = nullptr;  // [T, topk] cache slots, -1 = skip
  int32_t topk = 0;                  // >= 1
  float softmax_scale = 0.0f;        // ModelConfig::softmax_scale(), > 0
  // ---- outputs ----
  float* out = nullptr;              // [T, H, 512] fp32
  float* lse = nullptr;              // [T, H] fp32, natural log
};

/// Host-side validation (host pointers): sizes, scale, geometry, every index -1 or in [0, num_slots).
/// Throws pcpkv::Error, e.g. "sparse_mla: indices[5, 17] = 9000 is out of range [0, 8192)".
void validate_sparse_mla(const SparseMlaParams& p);

/// Per (token, head) data of the error model, from the fp64 reference (see SparseMlaBound):
struct SparseMlaRefStats {
  std::vector<double> abs_pv;     // [T, H, 512] sum_j p_j |v_j[d]|   (p: exact softmax weights)
  std::vector<double> max_abs_s;  // [T, H] max_j softmax_scale * sum_i |q_i k_ji|
  std::vector<int32_t> num_keys;  // [T] valid slots of the token
};

/// CPU reference (host pointers); validates first. stats (optional) receives the error-model data.
void sparse_mla_cpu(const SparseMlaParams& p, SparseMlaRefStats* stats = nullptr);

/// Error bound of an fp32 computation against the fp64 reference, per value (u = 2^-24, K = num_keys):
///   score error  delta = (576 + 8) * u * max_abs_s          (any summation order of 576 terms, the
///                                                             scale multiply and the max subtraction)
///   sums         sigma = (2K + 16 * min(K, 256) + 64) * u   (K-term sums; per online-softmax tile of
///                                                             32 keys: exp, rescale, warp sums)
///   |out - ref| <= (2 * delta + sigma) * abs_pv[d] + 2u * |ref| + 1e-30
///   |lse - ref| <=      delta + sigma  + 2u * |ref|
/// (softmax weights move by at most 2*delta relative when scores move by delta). An lse of -inf (no
/// valid key) must match -inf exactly, and then out must be 0.
/// dcp_shards > 0: bound for "partials over dcp_shards shards + LSE merge" against another fp32 result
/// of the same problem: both sides' errors, merge weights moved by twice the partial-LSE bound, and the
/// merge's own rounding (lse_merge.h).
struct SparseMlaBound {
  static double out_bound(double abs_pv, double max_abs_s, int32_t num_keys, double ref, double ref_lse,
                           int dcp_shards = 0);
  static double lse_bound(double max_abs_s, int32_t num_keys, double ref, int dcp_shards = 0);
};

namespace cuda {
/// CUDA kernel (device pointers, stream a cudaStream_t). Checks the scalar fields (throws
/// pcpkv::Error); an index outside [-1, num_slots) on the device is skipped like -1 (validate on the
/// host first: validate_sparse_mla).
void sparse_mla(const SparseMlaParams& p, void* stream);
}  // namespace cuda

}  // namespace pcpkv
