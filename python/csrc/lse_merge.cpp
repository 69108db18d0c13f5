// python/csrc/lse_merge.cpp: torch.ops.pcpkv.lse_merge (schema: registry.cpp; docstring: pcpkv_torch/consumers.py),
// the merge of attention shards by their log-sum-exp. The arguments by name (LseMergeArgs), their checks, the CPU
// implementation on pcpkv::lse_merge_reference and, in CUDA builds, the CUDA one on pcpkv::cuda::lse_merge.
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "binding.h"
#include "checks.h"
#include "pcpkv/consumers/lse_merge.h"

#ifdef PCPKV_TORCH_CUDA
#include "cuda_launch.h"
#endif

namespace pcpkv_torch {
namespace {

struct LseMergeArgs {
  at::Tensor outs, lses, out, lse;  // float32 [S, T, H, D], [S, T, H] -> [T, H, D], [T, H]
};

constexpr Binding kLseMerge{"pcpkv::lse_merge",
                            PCPKV_ARG(LseMergeArgs, outs),
                            PCPKV_ARG(LseMergeArgs, lses),
                            PCPKV_ARG(LseMergeArgs, out),
                            PCPKV_ARG(LseMergeArgs, lse)};

pcpkv::LseMergeParams make_lse_merge_params(const LseMergeArgs& a) {
  TORCH_CHECK_VALUE(a.outs.defined(), "lse_merge: outs: missing");
  const c10::Device dev = a.outs.device();
  check_nd(a.outs, "lse_merge: outs", at::kFloat, 4, "[num_shards, num_tokens, num_heads, head_dim]", dev);
  const int64_t S = a.outs.size(0), T = a.outs.size(1), H = a.outs.size(2), D = a.outs.size(3);
  TORCH_CHECK_VALUE(S >= 1 && S <= std::numeric_limits<int32_t>::max(), "lse_merge: outs: num_shards = ", S,
                    " must be >= 1");
  TORCH_CHECK_VALUE(D >= 1 && D <= std::numeric_limits<int32_t>::max(), "lse_merge: outs: head_dim = ", D,
                    " must be >= 1");
  check_dense(a.lses, "lse_merge: lses", {S, T, H}, at::kFloat, dev);
  check_dense(a.out, "lse_merge: out", {T, H, D}, at::kFloat, dev);
  check_dense(a.lse, "lse_merge: lse", {T, H}, at::kFloat, dev);
  refuse_overlap("lse_merge", {{"out", &a.out}, {"lse", &a.lse}}, {{"outs", &a.outs}, {"lses", &a.lses}}, true);
  pcpkv::LseMergeParams p;
  p.num_shards = static_cast<int32_t>(S);
  p.num_rows = T * H;
  p.head_dim = static_cast<int32_t>(D);
  p.outs = a.outs.data_ptr<float>();
  p.lses = a.lses.data_ptr<float>();
  p.out = a.out.data_ptr<float>();
  p.lse = a.lse.data_ptr<float>();
  return p;
}

void lse_merge_cpu(const LseMergeArgs& a) {
  const pcpkv::LseMergeParams p = make_lse_merge_params(a);
  translate_errors([&] { pcpkv::lse_merge_reference(p); });
}

#ifdef PCPKV_TORCH_CUDA
void lse_merge_cuda(const LseMergeArgs& a) {
  require_cuda(a.outs, "lse_merge: outs");
  const c10::Device dev = a.outs.device();
  const c10::cuda::CUDAGuard guard(dev);
  const pcpkv::LseMergeParams p = make_lse_merge_params(a);
  translate_errors([&] { pcpkv::cuda::lse_merge(p, current_stream(dev)); });  // checks scalars, then launches
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) { m.impl("lse_merge", kernel<kLseMerge, &lse_merge_cpu>()); }
#ifdef PCPKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) { m.impl("lse_merge", kernel<kLseMerge, &lse_merge_cuda>()); }
#endif

}  // namespace pcpkv_torch
