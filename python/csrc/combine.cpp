// python/csrc/combine.cpp: torch.ops.pcpkv.combine (schema: registry.cpp; docstring: pcpkv_torch/ops.py combine):
// staging rows -> local caches. The arguments by name (CombineArgs), their checks, the CPU implementation on
// pcpkv::combine_reference and, in CUDA builds, the CUDA one on pcpkv's launch_combine.
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "binding.h"
#include "checks.h"
#include "pcpkv/publish/cpu.h"

#ifdef PCPKV_TORCH_CUDA
#include "cuda_launch.h"
#include "pcpkv/publish/kernels.h"
#endif

namespace pcpkv_torch {
namespace {

struct CombineArgs {
  at::Tensor rows, slot_mapping, mla_cache;
  std::optional<at::Tensor> index_cache;
  std::string kv_format, ds_mla_scale;
  double k_scale = 1.0;
  bool has_indexer = true;
  std::optional<at::Tensor> indexer_slot_mapping;  // the indexer rows' own gathered slots (docs/spec.md 4.2)
};

constexpr Binding kCombine{"pcpkv::combine",
                           PCPKV_ARG(CombineArgs, rows),
                           PCPKV_ARG(CombineArgs, slot_mapping),
                           PCPKV_ARG(CombineArgs, mla_cache),
                           PCPKV_ARG(CombineArgs, index_cache),
                           PCPKV_ARG(CombineArgs, kv_format),
                           PCPKV_ARG(CombineArgs, ds_mla_scale),
                           PCPKV_ARG(CombineArgs, k_scale),
                           PCPKV_ARG(CombineArgs, has_indexer),
                           PCPKV_ARG(CombineArgs, indexer_slot_mapping)};

/// Checks the tensors of a combine (staging rows -> local caches) and fills the contract.
pcpkv::CombineParams make_combine_params(const CombineArgs& a) {
  pcpkv::CombineParams p;
  p.fmt = make_format(a.kv_format, a.ds_mla_scale, a.k_scale, a.has_indexer);
  p.target = target_of(a.mla_cache, a.index_cache, p.fmt, "combine");
  const c10::Device dev = a.mla_cache.device();
  const at::Tensor& rows = a.rows;
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kByte && rows.dim() == 3 && rows.is_contiguous() && rows.device() == dev,
                    "combine: rows: expected contiguous uint8 [num_src_ranks, max_local_tokens, row_bytes] on ", dev,
                    ", got ", describe(rows));
  p.rows = rows.data_ptr<uint8_t>();
  p.num_src_ranks = static_cast<int32_t>(rows.size(0));
  p.max_local_tokens = rows.size(1);
  p.row_bytes = rows.size(2);
  check_vector(a.slot_mapping, "combine: slot_mapping", rows.size(0) * rows.size(1), at::kLong, dev);
  p.slot_mapping = a.slot_mapping.data_ptr<int64_t>();
  const int64_t num_rows = rows.size(0) * rows.size(1);
  p.indexer_slot_mapping =
      indexer_slots(a.indexer_slot_mapping, "combine", a.has_indexer ? nullptr : "has_indexer=False", num_rows, dev);
  // Rows are copied in any order (on the GPU by many blocks at once): a cache overlapping the rows, the slots or
  // the other cache would read or clobber bytes another row writes.
  refuse_overlap("combine", written_caches(a.mla_cache, a.index_cache, p.fmt),
                 {{"rows", &rows},
                  {"slot_mapping", &a.slot_mapping},
                  {"indexer_slot_mapping", maybe(a.indexer_slot_mapping)}},
                 true);
  return p;
}

void combine_cpu(const CombineArgs& a) {
  const pcpkv::CombineParams p = make_combine_params(a);
  translate_errors([&] { pcpkv::combine_reference(p, cpu_threads()); });
}

#ifdef PCPKV_TORCH_CUDA
void combine_cuda(const CombineArgs& a) {
  require_cuda(a.mla_cache, "combine: mla_cache");
  const c10::cuda::CUDAGuard guard(a.mla_cache.device());
  const pcpkv::CombineParams p = make_combine_params(a);
  TORCH_CHECK_VALUE(addr(p.rows) % 16 == 0, "combine: rows must be 16-byte aligned, got ", describe(a.rows),
                    " at offset ", a.rows.storage_offset());
  translate_errors([&] { pcpkv::cuda::launch_combine(&p, 1, current_stream(a.mla_cache.device())); });
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) { m.impl("combine", kernel<kCombine, &combine_cpu>()); }
#ifdef PCPKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) { m.impl("combine", kernel<kCombine, &combine_cuda>()); }
#endif

}  // namespace pcpkv_torch
