// python/csrc/sparse_mla.cpp: torch.ops.pcpkv.sparse_mla (schema: registry.cpp; docstring: pcpkv_torch/consumers.py),
// sparse MLA attention over the top-k rows of the paged MLA cache. The arguments by name (SparseMlaArgs), their
// checks, the CPU implementation on pcpkv::sparse_mla_reference (the oracle; it validates every index first) and, in
// CUDA builds, the CUDA one on pcpkv::cuda::sparse_mla.
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <string>

#include "binding.h"
#include "checks.h"
#include "pcpkv/consumers/sparse_mla.h"

#ifdef PCPKV_TORCH_CUDA
#include "cuda_launch.h"
#endif

namespace pcpkv_torch {
namespace {

struct SparseMlaArgs {
  at::Tensor q, mla_cache, indices, out, lse;
  std::string kv_format, ds_mla_scale;
  double k_scale = 1.0, softmax_scale = 0.0;
  std::string scale_read;  // "fp32" | "bf16" (SparseMlaParams::scales_as_bf16)
  std::string kernel;      // "mma" | "simt": the CUDA kernel (checked on every device)
};

constexpr Binding kSparseMla{"pcpkv::sparse_mla",
                             PCPKV_ARG(SparseMlaArgs, q),
                             PCPKV_ARG(SparseMlaArgs, mla_cache),
                             PCPKV_ARG(SparseMlaArgs, indices),
                             PCPKV_ARG(SparseMlaArgs, out),
                             PCPKV_ARG(SparseMlaArgs, lse),
                             PCPKV_ARG(SparseMlaArgs, kv_format),
                             PCPKV_ARG(SparseMlaArgs, ds_mla_scale),
                             PCPKV_ARG(SparseMlaArgs, k_scale),
                             PCPKV_ARG(SparseMlaArgs, softmax_scale),
                             PCPKV_ARG(SparseMlaArgs, scale_read),
                             PCPKV_ARG(SparseMlaArgs, kernel)};

pcpkv::SparseMlaParams make_sparse_mla_params(const SparseMlaArgs& a) {
  TORCH_CHECK_VALUE(a.q.defined(), "sparse_mla: q: missing");
  const c10::Device dev = a.q.device();
  check_nd(a.q, "sparse_mla: q", at::kBFloat16, 3, "[num_tokens, num_heads, 576]", dev);
  const int64_t T = a.q.size(0), H = a.q.size(1);
  TORCH_CHECK_VALUE(a.q.size(2) == 576 && H >= 1 && H <= std::numeric_limits<int32_t>::max(),
                    "sparse_mla: q: expected bfloat16 [num_tokens, num_heads >= 1, 576], got ", describe(a.q));
  check_nd(a.indices, "sparse_mla: indices", at::kInt, 2, "[num_tokens, topk]", dev);
  TORCH_CHECK_VALUE(a.indices.size(0) == T && a.indices.size(1) >= 1 &&
                        a.indices.size(1) <= std::numeric_limits<int32_t>::max(),
                    "sparse_mla: indices: expected int32 [num_tokens=", T, ", topk >= 1], got ", describe(a.indices));
  check_dense(a.out, "sparse_mla: out", {T, H, 512}, at::kFloat, dev);
  check_dense(a.lse, "sparse_mla: lse", {T, H}, at::kFloat, dev);
  TORCH_CHECK_VALUE(a.mla_cache.defined() && a.mla_cache.device() == dev,
                    "sparse_mla: mla_cache: expected a tensor on ", dev, ", got ", describe(a.mla_cache));
  // As the indexer: out and lse are written per (token, head) in any order, so neither may hold an input or the
  // other (lse a view into out).
  refuse_overlap("sparse_mla", {{"out", &a.out}, {"lse", &a.lse}},
                 {{"q", &a.q}, {"mla_cache", &a.mla_cache}, {"indices", &a.indices}}, true);
  // The float32 the kernels read, checked as given (1e300 would become inf, 1e-50 zero).
  const float scale = translate_errors([&] { return pcpkv::sparse_mla_softmax_scale(a.softmax_scale); });
  TORCH_CHECK_VALUE(a.scale_read == "fp32" || a.scale_read == "bf16", "sparse_mla: scale_read = '", a.scale_read,
                    "'; expected 'fp32' or 'bf16'");
  pcpkv::SparseMlaParams p;
  p.fmt = make_format(a.kv_format, a.ds_mla_scale, a.k_scale, false);
  p.geometry = mla_geometry_of(a.mla_cache, p.fmt.kv_format, "sparse_mla: mla_cache");
  p.num_tokens = T;
  p.num_heads = static_cast<int32_t>(H);
  p.q = static_cast<const uint16_t*>(a.q.data_ptr());
  p.mla_cache = static_cast<const uint8_t*>(a.mla_cache.data_ptr());
  p.indices = a.indices.data_ptr<int32_t>();
  p.topk = static_cast<int32_t>(a.indices.size(1));
  p.softmax_scale = scale;
  p.scales_as_bf16 = a.scale_read == "bf16";
  p.out = a.out.data_ptr<float>();
  p.lse = a.lse.data_ptr<float>();
  return p;
}

/// "mma" | "simt" -> the CUDA kernel (ValueError otherwise; checked on every device).
pcpkv::SparseMlaKernel parse_sparse_mla_kernel(const std::string& kernel) {
  TORCH_CHECK_VALUE(kernel == "mma" || kernel == "simt", "sparse_mla: kernel = '", kernel,
                    "'; expected 'mma' or 'simt'");
  return kernel == "mma" ? pcpkv::SparseMlaKernel::kMma : pcpkv::SparseMlaKernel::kSimt;
}

void sparse_mla_cpu(const SparseMlaArgs& a) {
  parse_sparse_mla_kernel(a.kernel);  // checked here too; the CPU reference is one kernel
  const pcpkv::SparseMlaParams p = make_sparse_mla_params(a);
  translate_errors([&] { pcpkv::sparse_mla_reference(p); });  // validates every index first
}

#ifdef PCPKV_TORCH_CUDA
void sparse_mla_cuda(const SparseMlaArgs& a) {
  require_cuda(a.q, "sparse_mla: q");
  const c10::Device dev = a.q.device();
  const c10::cuda::CUDAGuard guard(dev);
  const pcpkv::SparseMlaKernel k = parse_sparse_mla_kernel(a.kernel);
  const pcpkv::SparseMlaParams p = make_sparse_mla_params(a);
  translate_errors([&] { pcpkv::cuda::sparse_mla(p, current_stream(dev), k); });  // returns at once when T = 0
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) { m.impl("sparse_mla", kernel<kSparseMla, &sparse_mla_cpu>()); }
#ifdef PCPKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) { m.impl("sparse_mla", kernel<kSparseMla, &sparse_mla_cuda>()); }
#endif

}  // namespace pcpkv_torch
