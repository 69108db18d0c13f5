// python/csrc/indexer_topk.cpp: torch.ops.pcpkv.indexer_topk (schema: registry.cpp; docstring:
// pcpkv_torch/consumers.py), the DSA indexer's top-k over the indexer-K cache. The arguments by name (IndexerArgs),
// their checks, the CPU implementation on pcpkv::indexer_reference (the oracle, after the library's full host
// validation) and, in CUDA builds, the CUDA one on pcpkv::cuda::indexer. On CUDA the values (positions, block tables)
// stay on the device: only the library's scalar checks run, and the workspace comes from torch's caching allocator
// (capturable in a CUDA graph).
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "binding.h"
#include "checks.h"
#include "pcpkv/consumers/indexer.h"

#ifdef PCPKV_TORCH_CUDA
#include "cuda_launch.h"
#include <ATen/Functions.h>
#endif

namespace pcpkv_torch {
namespace {

struct IndexerArgs {
  at::Tensor q_fp8, q_scale, weights, positions, request_idx, block_tables, index_cache, out;
  std::optional<at::Tensor> positions_out;
  int64_t topk = 0;
  std::optional<int64_t> max_keys;  // none: the implementation's bound (below)
  std::string logit;                // "exact" | "fp32_tree"
};

constexpr Binding kIndexerTopk{"pcpkv::indexer_topk",
                               PCPKV_ARG(IndexerArgs, q_fp8),
                               PCPKV_ARG(IndexerArgs, q_scale),
                               PCPKV_ARG(IndexerArgs, weights),
                               PCPKV_ARG(IndexerArgs, positions),
                               PCPKV_ARG(IndexerArgs, request_idx),
                               PCPKV_ARG(IndexerArgs, block_tables),
                               PCPKV_ARG(IndexerArgs, index_cache),
                               PCPKV_ARG(IndexerArgs, out),
                               PCPKV_ARG(IndexerArgs, positions_out),
                               PCPKV_ARG(IndexerArgs, topk),
                               PCPKV_ARG(IndexerArgs, max_keys),
                               PCPKV_ARG(IndexerArgs, logit)};

/// The indexer's contract over the tensors (no max_keys yet: each implementation sets it).
pcpkv::IndexerParams make_indexer_params(const IndexerArgs& a) {
  TORCH_CHECK_VALUE(a.q_fp8.defined(), "indexer_topk: q_fp8: missing");
  const c10::Device dev = a.q_fp8.device();
  check_nd(a.q_fp8, "indexer_topk: q_fp8", at::kByte, 3, "[num_tokens, num_heads, 128]", dev);
  const int64_t T = a.q_fp8.size(0), H = a.q_fp8.size(1);
  TORCH_CHECK_VALUE(a.q_fp8.size(2) == 128, "indexer_topk: q_fp8: expected uint8 [num_tokens, num_heads, 128], got ",
                    describe(a.q_fp8));
  TORCH_CHECK_VALUE(H >= 1 && H <= 128, "indexer_topk: q_fp8: num_heads = ", H, " must be in [1, 128]");
  check_dense(a.q_scale, "indexer_topk: q_scale", {T, H}, at::kFloat, dev);
  check_dense(a.weights, "indexer_topk: weights", {T, H}, at::kFloat, dev);
  check_vector(a.positions, "indexer_topk: positions", T, at::kLong, dev);
  check_vector(a.request_idx, "indexer_topk: request_idx", T, at::kInt, dev);
  check_nd(a.block_tables, "indexer_topk: block_tables", at::kInt, 2, "[num_requests, max_blocks]", dev);
  TORCH_CHECK_VALUE(a.index_cache.defined() && a.index_cache.device() == dev, "indexer_topk: index_cache: expected a ",
                    "tensor on ", dev, ", got ", describe(a.index_cache));
  TORCH_CHECK_VALUE(a.topk >= 1 && a.topk <= 8192, "indexer_topk: topk = ", a.topk, " must be in [1, 8192]");
  check_dense(a.out, "indexer_topk: out", {T, a.topk}, at::kInt, dev);
  if (has(a.positions_out)) check_dense(*a.positions_out, "indexer_topk: positions_out", {T, a.topk}, at::kInt, dev);
  // Rows are scored and written in any order (on the GPU by many blocks at once): an output holding an input (out =
  // request_idx.view(T, 1), out = block_tables) or the other output would be read after it was overwritten.
  refuse_overlap("indexer_topk", {{"out", &a.out}, {"positions_out", maybe(a.positions_out)}},
                 {{"q_fp8", &a.q_fp8}, {"q_scale", &a.q_scale}, {"weights", &a.weights}, {"positions", &a.positions},
                  {"request_idx", &a.request_idx}, {"block_tables", &a.block_tables}, {"index_cache", &a.index_cache}},
                 true);
  pcpkv::IndexerParams p;
  TORCH_CHECK_VALUE(a.logit == "exact" || a.logit == "fp32_tree", "indexer_topk: logit = '", a.logit,
                    "'; expected 'exact' or 'fp32_tree'");
  p.logit = a.logit == "exact" ? pcpkv::IndexerLogit::kExact : pcpkv::IndexerLogit::kFp32Tree;
  p.geometry = index_geometry_of(a.index_cache, "indexer_topk: index_cache");
  p.num_tokens = T;
  p.num_heads = static_cast<int32_t>(H);
  p.q_fp8 = a.q_fp8.data_ptr<uint8_t>();
  p.q_scale = a.q_scale.data_ptr<float>();
  p.weights = a.weights.data_ptr<float>();
  p.positions = a.positions.data_ptr<int64_t>();
  p.request_idx = a.request_idx.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(a.block_tables.size(0) <= std::numeric_limits<int32_t>::max(),
                    "indexer_topk: block_tables: ", a.block_tables.size(0), " requests is too many");
  p.block_tables = a.block_tables.data_ptr<int32_t>();
  p.num_requests = static_cast<int32_t>(a.block_tables.size(0));
  p.block_table_stride = a.block_tables.size(1);
  p.index_cache = static_cast<const uint8_t*>(a.index_cache.data_ptr());
  p.topk = static_cast<int32_t>(a.topk);
  p.topk_slots = a.out.data_ptr<int32_t>();
  p.topk_positions = ptr_or_null<int32_t>(a.positions_out);
  translate_errors([&] { pcpkv::validate_indexer_scalars(p); });
  return p;
}

void indexer_topk_cpu(const IndexerArgs& a) {
  pcpkv::IndexerParams p = make_indexer_params(a);
  if (a.max_keys.has_value()) {
    p.max_keys = *a.max_keys;
  } else {  // max(positions of real tokens) + 1 (a bad position is then reported by validate_indexer)
    int64_t m = 0;
    for (int64_t t = 0; t < p.num_tokens; ++t)
      if (p.request_idx[t] != -1) m = std::max(m, p.positions[t]);
    p.max_keys = std::min<int64_t>(m, (int64_t{1} << 31) - 2) + 1;
  }
  translate_errors([&] { pcpkv::indexer_reference(p); });  // validates everything first
}

#ifdef PCPKV_TORCH_CUDA
// Scores of this many bytes per pass at most (more tokens per pass = fewer launches; 32K keys: 1024 tokens).
constexpr int64_t kIndexerWorkspaceCap = int64_t{128} << 20;

void indexer_topk_cuda(const IndexerArgs& a) {
  require_cuda(a.q_fp8, "indexer_topk: q_fp8");
  const c10::Device dev = a.q_fp8.device();
  const c10::cuda::CUDAGuard guard(dev);
  pcpkv::IndexerParams p = make_indexer_params(a);
  // Without max_keys: the most keys any token can address through its block table row (no host sync).
  p.max_keys =
      a.max_keys.has_value() ? *a.max_keys : std::max<int64_t>(1, p.block_table_stride * p.geometry.block_size);
  TORCH_CHECK_VALUE(p.max_keys >= 1 && p.max_keys < (int64_t{1} << 31), "indexer_topk: max_keys = ", p.max_keys,
                    " must be in [1, 2^31)", a.max_keys.has_value() ? "" : " (block_tables.size(1) * block_size)");
  if (p.num_tokens == 0) return;
  const int64_t min_bytes = translate_errors([&] { return pcpkv::cuda::indexer_min_workspace_bytes(p); });
  const int64_t per_pass = std::clamp<int64_t>(kIndexerWorkspaceCap / min_bytes, 1, p.num_tokens);
  const at::Tensor ws = at::empty({per_pass * min_bytes}, a.q_fp8.options().dtype(at::kByte));
  translate_errors([&] { pcpkv::cuda::indexer(p, ws.data_ptr(), ws.numel(), current_stream(dev)); });
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) { m.impl("indexer_topk", kernel<kIndexerTopk, &indexer_topk_cpu>()); }
#ifdef PCPKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) { m.impl("indexer_topk", kernel<kIndexerTopk, &indexer_topk_cuda>()); }
#endif

}  // namespace pcpkv_torch
