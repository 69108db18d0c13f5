// python/csrc/quantize_index_q.cpp: torch.ops.pcpkv.quantize_index_q and quantize_index_q_aten (schemas:
// registry.cpp; docstring: pcpkv_torch/consumers.py), the indexer queries' UE8M0-scaled E4M3 (SPEC section 3). The
// arguments by name (QuantizeArgs, both ops), their checks, the CPU implementation on pcpkv::quantize_index_queries
// (the oracle), and the same quantizer in ATen ops for any device (quantize_index_q_aten), which is the CUDA
// implementation.
#include <ATen/Functions.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "binding.h"
#include "checks.h"
#include "pcpkv/consumers/indexer.h"

#ifdef PCPKV_TORCH_CUDA
#include "cuda_launch.h"
#endif

namespace pcpkv_torch {
namespace {

struct QuantizeArgs {
  at::Tensor q, q_fp8, q_scale;  // bf16 [T, H, 128] -> uint8 [T, H, 128], float32 [T, H]
};

constexpr Binding kQuantize{"pcpkv::quantize_index_q", PCPKV_ARG(QuantizeArgs, q), PCPKV_ARG(QuantizeArgs, q_fp8),
                            PCPKV_ARG(QuantizeArgs, q_scale)};
constexpr Binding kQuantizeAten{"pcpkv::quantize_index_q_aten", PCPKV_ARG(QuantizeArgs, q),
                                PCPKV_ARG(QuantizeArgs, q_fp8), PCPKV_ARG(QuantizeArgs, q_scale)};

/// q bf16 [T, H, 128] -> q_fp8 uint8 [T, H, 128], q_scale float32 [T, H] (all contiguous, one device). Returns H
/// (>= 1).
int32_t check_quantize_index_q(const QuantizeArgs& a) {
  TORCH_CHECK_VALUE(a.q.defined(), "quantize_index_q: q: missing");
  check_nd(a.q, "quantize_index_q: q", at::kBFloat16, 3, "[num_tokens, num_heads, 128]", a.q.device());
  TORCH_CHECK_VALUE(a.q.size(2) == 128 && a.q.size(1) >= 1, "quantize_index_q: q: expected bfloat16 [num_tokens, ",
                    "num_heads >= 1, 128], got ", describe(a.q));
  const int64_t T = a.q.size(0), H = a.q.size(1);
  check_dense(a.q_fp8, "quantize_index_q: q_fp8", {T, H, 128}, at::kByte, a.q.device());
  check_dense(a.q_scale, "quantize_index_q: q_scale", {T, H}, at::kFloat, a.q.device());
  TORCH_CHECK_VALUE(H <= std::numeric_limits<int32_t>::max(), "quantize_index_q: num_heads = ", H, " is too large");
  refuse_overlap("quantize_index_q", {{"q_fp8", &a.q_fp8}, {"q_scale", &a.q_scale}}, {{"q", &a.q}}, true);
  return static_cast<int32_t>(H);
}

/// The same quantizer as pcpkv::quantize_index_queries (SPEC section 3, UE8M0 per (token, head)) in ATen ops, for any
/// device (the CUDA implementation): bit-identical to the C++ oracle for every input (NaN, inf, subnormals included;
/// the tests compare them on the CPU).
void quantize_index_q_aten(const QuantizeArgs& a) {
  check_quantize_index_q(a);
  if (a.q.numel() == 0) return;
  // codec::indexer_scale / quantize_e4m3 step by step. Divisions are tensor / tensor: ATen divides by a
  // scalar through its reciprocal on CUDA, which is not the contract's correctly rounded x / s.
  const at::Tensor x = a.q.to(at::kFloat);
  at::Tensor ax = x.abs();
  ax = at::where(at::isnan(ax), at::zeros_like(ax), ax);  // fp32::amax skips NaN lanes (from 0)
  const at::Tensor amax = std::get<0>(ax.max(-1));
  const at::Tensor r = at::div(at::maximum(amax, at::full_like(amax, 1e-4f)), at::full_like(amax, 448.0f));
  // ceil_log2 and exp2i on the bits (r > 0): 2^(e + (mantissa != 0)); r = inf (or >= 2^127) gives inf.
  const at::Tensor u = r.view(at::kInt);
  const at::Tensor e = at::bitwise_and(at::bitwise_right_shift(u, 23), 0xff);
  const at::Tensor k = at::add(e, at::ne(at::bitwise_and(u, 0x7fffff), 0).to(at::kInt));  // biased exponent of s
  const at::Tensor s = at::bitwise_left_shift(k, 23).view(at::kFloat);
  const at::Tensor y = at::div(x, s.unsqueeze(-1));
  // codec::float_to_e4m3: saturate to +-448 (ATen's e4m3fn cast would give NaN above 464), NaN -> 0x7f.
  at::Tensor b = at::clamp(y, -448.0, 448.0).to(at::kFloat8_e4m3fn).view(at::kByte);
  b = at::where(at::isnan(y), at::full_like(b, 0x7f), b);
  a.q_scale.copy_(s);
  a.q_fp8.copy_(b);
}

void quantize_index_q_cpu(const QuantizeArgs& a) {
  const int32_t H = check_quantize_index_q(a);
  translate_errors([&] {
    pcpkv::quantize_index_queries(static_cast<const uint16_t*>(a.q.data_ptr()), a.q.size(0), H,
                                  a.q_fp8.data_ptr<uint8_t>(), a.q_scale.data_ptr<float>());
  });
}

#ifdef PCPKV_TORCH_CUDA
void quantize_index_q_cuda(const QuantizeArgs& a) {
  require_cuda(a.q, "quantize_index_q: q");
  const c10::cuda::CUDAGuard guard(a.q.device());
  quantize_index_q_aten(a);  // ATen ops on the current stream
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) { m.impl("quantize_index_q", kernel<kQuantize, &quantize_index_q_cpu>()); }
#ifdef PCPKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) { m.impl("quantize_index_q", kernel<kQuantize, &quantize_index_q_cuda>()); }
#endif
TORCH_LIBRARY_IMPL(pcpkv, CompositeExplicitAutograd, m) {
  m.impl("quantize_index_q_aten", kernel<kQuantizeAten, &quantize_index_q_aten>());
}

}  // namespace pcpkv_torch
