// pcpkv/consumers/sparse_mla.h: sparse MLA attention over selected cache slots (SPEC section 6), absorbed form.
//
// For query token t, head h, valid selected slots j (indices[t, *] >= 0; -1 entries are skipped):
//   s_j   = softmax_scale * (q[t,h,0:512] . kv_c_j + q[t,h,512:576] . k_pe_j)
//   out   = sum_j exp(s_j - lse) * kv_c_j           [512]   (v = kv_c)
//   lse   = ln(sum_j exp(s_j))                       natural log, softmax scale included
// A query with no valid slot gives out = 0 and lse = -inf (so an LSE merge drops it). Duplicate slots
// count once per occurrence. Cache values are decoded exactly as pcpkv/device/consumers.h says.
//
// CPU reference: fp64 accumulation from the fp32 cache values and bf16 queries, rounded once to fp32.
// CUDA kernels (fixed order per token: deterministic, independent of batch and grid), SparseMlaKernel:
//   kMma (default): bf16 tensor cores (mma.sync m16n8k16), fp32 accumulation. The cache is read as exact
//     bf16 codes (E4M3 codes for the fp8 formats) and its scales are applied in fp32 outside the MMA:
//     s = softmax_scale * (sum_tile scale_tile * (q_tile . code_tile) + scale_pe * (q_pe . code_pe)),
//     out = sum_j bf16(p_j * scale_tile(j)) * code_j / l, l = sum_j p_j in fp32 (p_j = exp(s_j - m)).
//   kSimt: the first fp32 CUDA-core kernel (kept for comparison).
// Each kernel's error bound against the reference is SparseMlaBound with its SparseMlaArith (tests/cuda).
#pragma once

#include <cstdint>
#include <vector>

#include "pcpkv/core/layout.h"

namespace pcpkv {

/// CUDA attention kernel choice (see above).
enum class SparseMlaKernel : int32_t { kMma = 0, kSimt = 1 };
/// Arithmetic of a result, which sets its error bound: kFp32 (fp32 everywhere, the CUDA-core kernel; the
/// fp64 CPU reference is within it too) or kBf16Mma (tensor-core sums, P rounded to bf16).
enum class SparseMlaArith : int32_t { kFp32 = 0, kBf16Mma = 1 };
SparseMlaArith arith_of(SparseMlaKernel k);
const char* to_string(SparseMlaKernel k);

struct SparseMlaParams {
  int64_t num_tokens = 0;            // T
  int32_t num_heads = 0;             // H query heads (num_attention_heads), >= 1
  const uint16_t* q = nullptr;       // [T, H, 576] bf16: q_nope absorbed (512) | q_pe (64)
  const uint8_t* mla_cache = nullptr;// first byte of block 0 of the MLA cache
  MlaCacheGeometry geometry;
  CacheFormat fmt;                   // kv_format and k_scale (static fp8) are read
  const int32_t* indices = nullptr;  // [T, topk] cache slots, -1 = skip
  int32_t topk = 0;                  // >= 1
  float softmax_scale = 0.0f;        // ModelConfig::softmax_scale() through sparse_mla_softmax_scale()
  bool scales_as_bf16 = false;       // fp8_ds_mla: read tile scales rounded to bf16 (FlashMLA's SM90 reader;
                                     // consumers::ds_mla_read_scale); other formats ignore it
  // ---- outputs ----
  float* out = nullptr;              // [T, H, 512] fp32
  float* lse = nullptr;              // [T, H] fp32, natural log
};

/// SparseMlaParams::softmax_scale from a double (ModelConfig::softmax_scale(), a Python float): the float32 the
/// kernels read. Throws pcpkv::Error naming the value given ("sparse_mla: softmax_scale = 1e+300 must be ...")
/// unless it is finite, > 0 and a normal float32 (pcpkv::scale_problem of pcpkv/core/layout.h): a bare cast turns
/// 1e300 into inf and 1e-50 into 0, and the kernels' own check would then name the float, not the value given.
float sparse_mla_softmax_scale(double softmax_scale);

/// The float32 scales of `p` (softmax_scale; k_scale for "fp8"): normal float32s (scale_problem). Throws
/// pcpkv::Error naming the field and value. The one scale rule of validate_sparse_mla and the CUDA launcher.
void validate_sparse_mla_scales(const SparseMlaParams& p);

/// Host-side validation (host pointers): sizes, scales (softmax_scale and the fp8 k_scale: normal float32s,
/// scale_problem), geometry, every index -1 or in [0, num_slots).
/// Throws pcpkv::Error, e.g. "sparse_mla: indices[5, 17] = 9000 is out of range [0, 8192)".
void validate_sparse_mla(const SparseMlaParams& p);

/// Per (token, head) data of the error model, from the fp64 reference (see SparseMlaBound):
struct SparseMlaRefStats {
  std::vector<double> abs_pv;     // [T, H, 512] sum_j p_j |v_j[d]|   (p: exact softmax weights)
  std::vector<double> max_abs_s;  // [T, H] max_j softmax_scale * sum_i |q_i k_ji|
  std::vector<int32_t> num_keys;  // [T] valid slots of the token
};

/// CPU reference (host pointers); validates first. stats (optional) receives the error-model data.
void sparse_mla_reference(const SparseMlaParams& p, SparseMlaRefStats* stats = nullptr);

/// Error bound of a computation against the fp64 reference, per value (u = 2^-24, K = num_keys):
///   kFp32:     score error delta = (576 + 8) u max_abs_s    (any summation order of 576 terms, the
///                                                             scale multiply and the max subtraction)
///              sums        sigma = (2K + 16 min(K, 256) + 64) u  (K-term sums; per online-softmax tile:
///                                                             exp, rescale, warp sums)
///              P rounding  rho   = 0
///   kBf16Mma:  delta = (4 * 576 + 16) u max_abs_s   (tensor-core fp32 sums truncate after aligning to
///                                                     the block's largest exponent: up to 2 ulp per term
///                                                     and block, 4x the round-to-nearest count covers it;
///                                                     plus the fp32 decode rounding the reference did)
///              sigma = 2 (2K + 16 min(K, 256) + 64) u     (same sums, truncating)
///              rho   = 2^-8 + u                            (each weight p_j * scale rounded to bf16)
///   |out - ref| <= (2 * delta + sigma + rho) * abs_pv[d] + 2u * |ref| + 1e-30
///   |lse - ref| <=      delta + sigma        + 2u * |ref|       (l sums the unrounded fp32 p_j)
/// (softmax weights move by at most 2*delta relative when scores move by delta). An lse of -inf (no
/// valid key) must match -inf exactly, and then out must be 0.
/// dcp_shards > 0: bound for "partials over dcp_shards shards + LSE merge" against another result of the
/// same problem with the same arithmetic: both sides' errors, merge weights moved by twice the
/// partial-LSE bound, and the merge's own rounding (lse_merge.h).
struct SparseMlaBound {
  static double out_bound(double abs_pv, double max_abs_s, int32_t num_keys, double ref, double ref_lse,
                          int dcp_shards = 0, SparseMlaArith arith = SparseMlaArith::kFp32);
  static double lse_bound(double max_abs_s, int32_t num_keys, double ref, int dcp_shards = 0,
                          SparseMlaArith arith = SparseMlaArith::kFp32);
};

namespace cuda {
/// CUDA kernel (device pointers, stream a cudaStream_t). Checks the scalar fields (throws
/// pcpkv::Error); an index outside [-1, num_slots) on the device is skipped like -1 (validate on the
/// host first: validate_sparse_mla). kMma reads q and cache rows with 16-byte loads when q, the cache
/// base and both strides are multiples of 16 bytes, byte by byte otherwise (same arithmetic).
void sparse_mla(const SparseMlaParams& p, void* stream, SparseMlaKernel kernel = SparseMlaKernel::kMma);
}  // namespace cuda

}  // namespace pcpkv
