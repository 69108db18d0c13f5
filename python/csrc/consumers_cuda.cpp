// python/csrc/consumers_cuda.cpp: CUDA implementations of the consumer ops on pcpkv's kernels (cuda::indexer,
// cuda::sparse_mla, cuda::lse_merge), asynchronous on the current torch stream. Like ops_cuda.cpp: every
// host-side check (dtypes, shapes, devices, the library's scalar checks) before the launch; values on the
// device (positions, block tables, indices) are not read here, so nothing synchronizes. The indexer's
// workspace comes from torch's caching allocator (capturable in a CUDA graph).
#include <ATen/Functions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "common.h"
#include "consumers.h"

namespace pcpkv_torch {
namespace {

// Scores of this many bytes per pass at most (more tokens per pass = fewer launches; 32K keys: 1024 tokens).
constexpr int64_t kIndexerWorkspaceCap = int64_t{128} << 20;

cudaStream_t stream_of(const c10::Device& d) { return c10::cuda::getCurrentCUDAStream(d.index()).stream(); }

void require_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined() && t.is_cuda(), name, ": expected a CUDA tensor, got ", describe(t));
}

void quantize_index_q_cuda(const at::Tensor& q, const at::Tensor& q_fp8, const at::Tensor& q_scale) {
  require_cuda(q, "quantize_index_q: q");
  const c10::cuda::CUDAGuard guard(q.device());
  quantize_index_q_aten(q, q_fp8, q_scale);  // ATen ops on the current stream
}

void indexer_topk_cuda(const at::Tensor& q_fp8, const at::Tensor& q_scale, const at::Tensor& weights,
                       const at::Tensor& positions, const at::Tensor& request_idx, const at::Tensor& block_tables,
                       const at::Tensor& index_cache, const at::Tensor& out,
                       const std::optional<at::Tensor>& positions_out, int64_t topk, std::optional<int64_t> max_keys,
                       c10::string_view logit) {
  require_cuda(q_fp8, "indexer_topk: q_fp8");
  const c10::Device dev = q_fp8.device();
  const c10::cuda::CUDAGuard guard(dev);
  pcpkv::IndexerParams p = make_indexer_params(q_fp8, q_scale, weights, positions, request_idx, block_tables,
                                               index_cache, out, positions_out, topk, std::string(logit));
  // Without max_keys: the most keys any token can address through its block table row (no host sync).
  p.max_keys = max_keys.has_value() ? *max_keys : std::max<int64_t>(1, p.block_table_stride * p.geometry.block_size);
  TORCH_CHECK_VALUE(p.max_keys >= 1 && p.max_keys < (int64_t{1} << 31), "indexer_topk: max_keys = ", p.max_keys,
                    " must be in [1, 2^31)", max_keys.has_value() ? "" : " (block_tables.size(1) * block_size)");
  if (p.num_tokens == 0) return;
  const int64_t min_bytes = translate_errors([&] { return pcpkv::cuda::indexer_min_workspace_bytes(p); });
  const int64_t per_pass = std::clamp<int64_t>(kIndexerWorkspaceCap / min_bytes, 1, p.num_tokens);
  const at::Tensor ws = at::empty({per_pass * min_bytes}, q_fp8.options().dtype(at::kByte));
  translate_errors([&] { pcpkv::cuda::indexer(p, ws.data_ptr(), ws.numel(), stream_of(dev)); });
}

void sparse_mla_cuda(const at::Tensor& q, const at::Tensor& mla_cache, const at::Tensor& indices, const at::Tensor& out,
                     const at::Tensor& lse, c10::string_view kv_format, c10::string_view ds_mla_scale, double k_scale,
                     double softmax_scale, c10::string_view scale_read, c10::string_view kernel) {
  require_cuda(q, "sparse_mla: q");
  const c10::Device dev = q.device();
  const c10::cuda::CUDAGuard guard(dev);
  const pcpkv::SparseMlaKernel k = parse_sparse_mla_kernel(std::string(kernel));
  const pcpkv::SparseMlaParams p =
      make_sparse_mla_params(q, mla_cache, indices, out, lse, std::string(kv_format), std::string(ds_mla_scale),
                             k_scale, softmax_scale, std::string(scale_read));
  translate_errors([&] { pcpkv::cuda::sparse_mla(p, stream_of(dev), k); });  // returns at once when T = 0
}

void lse_merge_cuda(const at::Tensor& outs, const at::Tensor& lses, const at::Tensor& out, const at::Tensor& lse) {
  require_cuda(outs, "lse_merge: outs");
  const c10::Device dev = outs.device();
  const c10::cuda::CUDAGuard guard(dev);
  const pcpkv::LseMergeParams p = make_lse_merge_params(outs, lses, out, lse);
  translate_errors([&] { pcpkv::cuda::lse_merge(p, stream_of(dev)); });  // checks scalars, then launches
}

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) {
  m.impl("quantize_index_q", &quantize_index_q_cuda);
  m.impl("indexer_topk", &indexer_topk_cuda);
  m.impl("sparse_mla", &sparse_mla_cuda);
  m.impl("lse_merge", &lse_merge_cuda);
}

}  // namespace pcpkv_torch
