// pcpkv/serving/router.h: the MoE router of a decode step (SPEC section 7), and the FP8 per-token-group
// quantization of the MoE input that follows it.
//
//   logits[T, E] (fp32) = x[T, hidden] (bf16) . W[E, hidden]^T      W bf16 (or fp32), fp32 accumulation
//   grouped top-k (DeepSeek-V3 "noaux_tc"), per token t:
//     s[e]      = sigmoid(logit[e])                        (logit rounded to bf16 first when logits_bf16)
//     b[e]      = s[e] + e_score_correction_bias[e]        (biased score, used only to choose)
//     group g   = experts [g*E/n_group, (g+1)*E/n_group); group score = sum of its two largest b[e]
//     keep the topk_group groups with the largest group scores (ties: lower group index)
//     ids       = the top_k experts of the kept groups by b[e] (ties: lower expert index), in descending
//                 b[e] order; experts of dropped groups never win (masked to -inf, as vLLM/SGLang; HF's
//                 masked_fill(0.0) differs only when a kept expert has a negative biased score)
//     weight[i] = s[ids[i]] (unbiased), / (sum_i s[ids[i]] + 1e-20) when norm_topk_prob,
//                 * routed_scaling_factor
//
// The CPU reference computes in fp64 (exact products, fp64 sums); the CUDA kernels in fp32. The logit of
// a kernel differs from the exact value by at most
//   bound = router_logit_bound_factor(path, hidden) * 2^-24 * sum_k |x[t,k] * w[e,k]|
// (the classical gamma_n bound of the kernel's summation depth), so expert ids agree except where the
// decision itself is within the bound of a tie (routing_decision_gaps below finds those tokens).
//
// Host header: no CUDA headers. Device pointers of the CUDA entry points are raw pointers; streams are
// cudaStream_t (= CUstream_st*), forward-declared here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/core/model.h"

struct CUstream_st;

namespace pcpkv {

// ---- configuration -------------------------------------------------------------------------------

/// The router of one MoE layer. Field names follow HF config.json (ModelConfig's router fields).
struct RouterConfig {
  int64_t hidden_size = 0;           // K of the GEMM, multiple of 8
  int64_t n_experts = 0;             // n_routed_experts, <= 512
  int64_t top_k = 0;                 // num_experts_per_tok, 1..32
  int64_t n_group = 1;               // divides n_experts; each group holds >= 2 experts when n_group > 1
  int64_t topk_group = 1;            // 1..n_group; the kept groups must hold >= top_k experts
  double routed_scaling_factor = 1.0;
  bool norm_topk_prob = true;
  bool logits_bf16 = false;          // round logits to bf16 before routing (!router_logits_fp32)
};

/// The router of `model` (DeepSeek-V3.2: hidden 7168, 256 experts, 8 groups keep 4, bf16 logits;
/// GLM-5: hidden 6144, 256 experts, 1 group, fp32 logits). Validates it.
RouterConfig router_config(const ModelConfig& model);

/// Throws pcpkv::Error naming the first unusable field and its value.
void validate_router_config(const RouterConfig& config);

enum class RouterWeightDtype : uint8_t { kBf16, kFp32 };
const char* to_string(RouterWeightDtype d);

/// Which GEMM computes the logits.
enum class RouterPath : uint8_t {
  kAuto,      // the dispatch table below
  kSmallT,    // pcpkv's CUDA-core kernel: a few experts per CTA, 16-byte loads, fp32 FMA chains
  kCublasLt,  // cuBLASLt bf16 x bf16 -> fp32 (fp32 weights: fp32 GEMM on an fp32 copy of x)
};
const char* to_string(RouterPath p);
RouterPath parse_router_path(const std::string& s);  // "auto" | "small" | "cublaslt"

/// Which small-T kernel computes kSmallT. Both use 128 threads per CTA and the same fp32 operation order
/// (each thread's FMA chain over its 16-byte vectors tid, tid+128, ... ascending; warp butterfly; pairwise
/// over the 4 warps), so their logits are bit-identical and share router_logit_bound_factor(kSmallT).
enum class RouterSmallKernel : uint8_t {
  kAuto,     // options only: the dispatch table's kernel
  kRowLoop,  // "small" (v1): W prefetched into registers, x read from L2 inside the FMA loop, one round trip
             // per 16-byte vector of each thread (kept for comparison)
  kStaged,   // "small2" (v2): every W and x load of a pass issued up front as cp.async into shared memory
             // (one W and one x round trip per pass, no register limit on loads in flight); token buckets
             // 1..8 (x of 16 tokens does not fit next to W in shared memory)
};
const char* to_string(RouterSmallKernel k);  // "auto" | "small" | "small2"
RouterSmallKernel parse_router_small_kernel(const std::string& s);
/// Largest token bucket the kStaged kernel is built for.
constexpr int64_t kRouterStagedMaxTokens = 8;

/// Error bound factor of a path's fp32 logit (see the header comment): kSmallT = 8 * ceil(hidden/1024)
/// (each thread's FMA chain) + 5 (warp butterfly) + 2 (pairwise over 4 warps) + 1 (slack); kCublasLt and
/// kAuto = 2 * hidden (any summation order, tensor-core adders that may truncate: 2 units per addition).
double router_logit_bound_factor(RouterPath path, int64_t hidden);

// ---- the dispatch table (one place; values are measured with `pcpkv bench-serving`) ----------------

/// Row of the small-T / cuBLASLt dispatch: applies to num_tokens <= max_tokens (first matching row).
struct RouterDispatchEntry {
  int32_t max_tokens = 0;
  RouterPath path = RouterPath::kSmallT;
  int32_t experts_per_cta = 1;       // kSmallT: experts per CTA (1, 2, 4 or 8; divides n_experts)
  RouterSmallKernel kernel = RouterSmallKernel::kRowLoop;  // kSmallT: which kernel (never kAuto)
};
/// The table, ascending max_tokens, last row max_tokens = INT32_MAX. Measured on the H200 (see
/// src/serving/drivers/router_dispatch.cpp for the date and the command).
const std::vector<RouterDispatchEntry>& router_dispatch_table();
/// The row for num_tokens >= 1 (throws on num_tokens < 1).
RouterDispatchEntry router_dispatch(int64_t num_tokens);
/// Token count the small-T kernel is compiled for: the smallest of 1, 2, 4, 8, 16, 32 >= num_tokens.
/// Throws for num_tokens outside [1, 32].
int32_t router_token_bucket(int64_t num_tokens);
constexpr int64_t kRouterSmallMaxTokens = 32;

// ---- CPU reference (fp64) ------------------------------------------------------------------------

/// logits[t, e] = sum_k x[t, k] * w[e, k] in fp64 (every product exact, fp64 sum), and, when abs_sum is
/// non-null, abs_sum[t, e] = sum_k |x[t, k] * w[e, k]| (the scale of the error bound).
/// x: [num_tokens, hidden] bf16 bits, row stride x_stride (>= hidden); w: [n_experts, hidden] bf16 bits
/// (w_dtype kBf16, uint16_t) or fp32 (kFp32, float), contiguous; logits, abs_sum: [num_tokens, n_experts].
/// Throws pcpkv::Error on null pointers, hidden not a multiple of 8, x_stride < hidden, num_tokens < 0.
void router_logits_reference(const uint16_t* x, int64_t x_stride, const void* w, RouterWeightDtype w_dtype,
                             int64_t num_tokens, int64_t hidden, int64_t n_experts, double* logits,
                             double* abs_sum);

/// Grouped top-k of the header comment, in fp64. logits: [num_tokens, n_experts] (when
/// config.logits_bf16 each logit is first rounded to fp32, then to bf16); bias: [n_experts]
/// (e_score_correction_bias, fp32; null = zeros). ids: [num_tokens, top_k] int32 in descending biased-score
/// order; weights: [num_tokens, top_k]. Throws pcpkv::Error on a bad config or null output pointers.
void grouped_topk_reference(const double* logits, int64_t num_tokens, const float* bias,
                            const RouterConfig& config, int32_t* ids, double* weights);
/// Same, from fp32 logits (e.g. a kernel's), converted exactly to fp64.
void grouped_topk_reference(const float* logits, int64_t num_tokens, const float* bias,
                            const RouterConfig& config, int32_t* ids, double* weights);

/// How close one token's routing decision is to a tie, in biased-score units (fp64, from `logits`):
/// group_gap = (group score of the last kept group) - (best dropped group's score), +inf when every group
/// is kept; expert_gap = (biased score of the last chosen expert) - (best unchosen expert of the kept
/// groups), +inf when the kept groups hold exactly top_k experts. A kernel whose biased scores are each
/// within d of exact can only choose differently when group_gap <= 4d or expert_gap <= 2d.
struct RoutingGaps {
  double group_gap = 0.0;
  double expert_gap = 0.0;
};
std::vector<RoutingGaps> routing_decision_gaps(const double* logits, int64_t num_tokens, const float* bias,
                                               const RouterConfig& config);

// ---- FP8 per-token-group quantization (the MoE input after the router; PDL chain b) ---------------

/// Scale rule of FP8 per-token-group quantization (group of kFp8QuantGroup elements):
///   kFp32:  s = max(amax, 1e-4) / 448                           stored as fp32
///   kUe8m0: s = 2^ceil(log2(max(amax, 1e-4) / 448))             stored as fp32 (a power of two) or, with
///           Fp8GroupQuantParams::scales_ue8m0_bytes, as the E8M0 byte (biased exponent, s = 2^(b - 127))
/// q = E4M3(x / s) (division, SPEC section 3 rounding, saturating). Bit-exact between CPU and CUDA.
enum class Fp8ScaleFormat : uint8_t { kFp32, kUe8m0 };
constexpr int64_t kFp8QuantGroup = 128;

/// x: [num_tokens, hidden] bf16 (row stride x_stride); q: [num_tokens, hidden] e4m3, contiguous;
/// scales: element (t, g) at scales[t * scale_token_stride + g * scale_group_stride] (fp32, or uint8 when
/// scales_ue8m0_bytes): row-major [T, hidden/128] by default (scale_token_stride 0 means hidden/128),
/// column-major [hidden/128, T] with token stride 1 and group stride T (DeepGEMM's MN-major layout).
/// hidden is a multiple of 128.
struct Fp8GroupQuantParams {
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  const uint16_t* x = nullptr;
  int64_t x_stride = 0;
  uint8_t* q = nullptr;
  void* scales = nullptr;
  int64_t scale_token_stride = 0;
  int64_t scale_group_stride = 1;
  Fp8ScaleFormat format = Fp8ScaleFormat::kUe8m0;
  bool scales_ue8m0_bytes = false;   // only with kUe8m0
};
/// The token stride of the scales in effect (scale_token_stride, or hidden / 128 when it is 0).
inline int64_t fp8_scale_token_stride(const Fp8GroupQuantParams& p) {
  return p.scale_token_stride != 0 ? p.scale_token_stride : p.hidden / kFp8QuantGroup;
}
/// Throws pcpkv::Error naming the field (hidden % 128, strides, null pointers, bytes with kFp32).
void validate_fp8_group_quant(const Fp8GroupQuantParams& p);
/// CPU reference (host pointers).
void fp8_group_quant_reference(const Fp8GroupQuantParams& p);
/// The consumer of PDL chain b: y[t, k] = bf16(e4m3_to_float(q[t, k]) * s(t, k / 128)), one rounding.
/// y: [num_tokens, hidden] bf16, contiguous. Host pointers.
void fp8_group_dequant_reference(const Fp8GroupQuantParams& p, uint16_t* y);

}  // namespace pcpkv

// ---- CUDA ----------------------------------------------------------------------------------------
namespace pcpkv::cuda {

struct RouterGemmOptions {
  RouterPath path = RouterPath::kAuto;
  int32_t experts_per_cta = 0;   // kSmallT: 0 = the dispatch table's value
  bool pdl = false;              // launch with programmatic stream serialization (pcpkv/core/pdl.h)
  RouterSmallKernel small_kernel = RouterSmallKernel::kAuto;  // kSmallT: kAuto = the dispatch table's
};

/// The router GEMM on one device. Owns a cuBLASLt handle, a 32 MiB workspace and (for fp32 weights) an
/// fp32 copy of x for the cuBLASLt path; cheap to call, safe to capture into a CUDA graph once the
/// cuBLASLt algorithm for that token count was chosen (run it once before capturing).
class RouterGemm {
 public:
  /// Throws pcpkv::Error for hidden not a multiple of 8, n_experts outside [1, 512] or no CUDA device.
  RouterGemm(int64_t hidden, int64_t n_experts, RouterWeightDtype w_dtype);
  ~RouterGemm();
  RouterGemm(const RouterGemm&) = delete;
  RouterGemm& operator=(const RouterGemm&) = delete;

  /// logits [num_tokens, n_experts] fp32, contiguous = x [num_tokens, hidden] bf16 (row stride x_stride,
  /// 16-byte aligned rows) . w [n_experts, hidden] (bf16 or fp32 per w_dtype, contiguous, 16-byte aligned)^T.
  /// Device pointers, asynchronous on `stream`. num_tokens 0 is a no-op. Throws pcpkv::Error on bad shapes,
  /// misaligned pointers, kSmallT with num_tokens > 32 (kStaged: > 8), or a CUDA/cuBLAS failure.
  void run(const uint16_t* x, int64_t x_stride, const void* w, float* logits, int64_t num_tokens,
           CUstream_st* stream, const RouterGemmOptions& options = {});

  int64_t hidden() const;
  int64_t n_experts() const;
  RouterWeightDtype w_dtype() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Grouped top-k on the device: logits [num_tokens, n_experts] fp32, bias [n_experts] fp32 (null = zeros),
/// ids [num_tokens, top_k] int32, weights [num_tokens, top_k] fp32. One warp per token; fp32 math
/// (sigmoid = 1 / (1 + expf(-x))). Throws pcpkv::Error on a bad config.
void grouped_topk(const float* logits, int64_t num_tokens, const float* bias, const RouterConfig& config,
                  int32_t* ids, float* weights, CUstream_st* stream, bool pdl = false);

/// FP8 per-token-group quantization and its dequantizing consumer on the device (device pointers,
/// bit-exact to the CPU references). One warp per (token, group).
void fp8_group_quant(const Fp8GroupQuantParams& p, CUstream_st* stream, bool pdl = false);
void fp8_group_dequant(const Fp8GroupQuantParams& p, uint16_t* y, CUstream_st* stream, bool pdl = false);

}  // namespace pcpkv::cuda
