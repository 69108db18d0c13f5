// python/csrc/insert.cpp: torch.ops.pcpkv.insert (schema: registry.cpp; docstring: pcpkv_torch/ops.py insert): a
// rank's rows into its local caches (the collect path). The arguments by name (InsertArgs), their checks, the CPU
// implementation on pcpkv::insert_reference and, in CUDA builds, the CUDA one on pcpkv's launch_insert_mla /
// launch_insert_indexer.
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

struct InsertArgs {
  at::Tensor kv_c, k_pe;
  std::optional<at::Tensor> index_k;  // given: a layer with an indexer
  at::Tensor slot_mapping, mla_cache;
  std::optional<at::Tensor> index_cache;
  std::string kv_format, ds_mla_scale;
  double k_scale = 1.0;
  std::optional<at::Tensor> indexer_slot_mapping;  // the indexer rows' own slots (docs/spec.md 4.2)
};

constexpr Binding kInsert{"pcpkv::insert",
                          PCPKV_ARG(InsertArgs, kv_c),
                          PCPKV_ARG(InsertArgs, k_pe),
                          PCPKV_ARG(InsertArgs, index_k),
                          PCPKV_ARG(InsertArgs, slot_mapping),
                          PCPKV_ARG(InsertArgs, mla_cache),
                          PCPKV_ARG(InsertArgs, index_cache),
                          PCPKV_ARG(InsertArgs, kv_format),
                          PCPKV_ARG(InsertArgs, ds_mla_scale),
                          PCPKV_ARG(InsertArgs, k_scale),
                          PCPKV_ARG(InsertArgs, indexer_slot_mapping)};

/// Checks the tensors of an insert and fills the contract; has_indexer = index_k given.
pcpkv::InsertParams make_insert_params(const InsertArgs& a) {
  pcpkv::InsertParams p;
  p.fmt = make_format(a.kv_format, a.ds_mla_scale, a.k_scale, has(a.index_k));
  p.target = target_of(a.mla_cache, a.index_cache, p.fmt, "insert");
  const c10::Device dev = a.mla_cache.device();
  // slot_mapping counts the local tokens: kv_c and k_pe are measured against it, so a short kv_c is not blamed on k_pe.
  if (a.slot_mapping.defined() && a.slot_mapping.dim() == 1)
    check_token_rows("insert", "kv_c", a.kv_c, a.k_pe, "slot_mapping", a.slot_mapping.size(0));
  const int64_t T = a.kv_c.dim() == 2 ? a.kv_c.size(0) : -1;
  check_dense(a.kv_c, "insert: kv_c", {T, 512}, at::kBFloat16, dev);
  check_dense(a.k_pe, "insert: k_pe", {T, 64}, at::kBFloat16, dev);
  check_vector(a.slot_mapping, "insert: slot_mapping", T, at::kLong, dev);
  p.num_tokens = T;
  p.kv_c = static_cast<const uint16_t*>(a.kv_c.data_ptr());
  p.k_pe = static_cast<const uint16_t*>(a.k_pe.data_ptr());
  p.slot_mapping = a.slot_mapping.data_ptr<int64_t>();
  p.indexer_slot_mapping = indexer_slots(a.indexer_slot_mapping, "insert",
                                         has(a.index_k) ? nullptr : "index_k is None (no indexer)", T, dev);
  if (has(a.index_k)) {
    check_dense(*a.index_k, "insert: index_k", {T, 128}, at::kBFloat16, dev);
    p.index_k = static_cast<const uint16_t*>(a.index_k->data_ptr());
  }
  // As in combine: rows are quantized and stored in any order, so no cache may overlap an input or the other cache.
  refuse_overlap("insert", written_caches(a.mla_cache, a.index_cache, p.fmt),
                 {{"kv_c", &a.kv_c},
                  {"k_pe", &a.k_pe},
                  {"index_k", maybe(a.index_k)},
                  {"slot_mapping", &a.slot_mapping},
                  {"indexer_slot_mapping", maybe(a.indexer_slot_mapping)}},
                 true);
  return p;
}

void insert_cpu(const InsertArgs& a) {
  const pcpkv::InsertParams p = make_insert_params(a);
  translate_errors([&] { pcpkv::insert_reference(p, cpu_threads()); });
}

#ifdef PCPKV_TORCH_CUDA
void insert_cuda(const InsertArgs& a) {
  require_cuda(a.mla_cache, "insert: mla_cache");
  const c10::cuda::CUDAGuard guard(a.mla_cache.device());
  const pcpkv::InsertParams p = make_insert_params(a);
  // Two launches (MLA rows, then indexer slots): everything either launcher checks is checked here first,
  // so the second can not fail after the first was enqueued.
  TORCH_CHECK_VALUE(addr(p.kv_c) % 16 == 0, "insert: kv_c must be 16-byte aligned");
  TORCH_CHECK_VALUE(addr(p.k_pe) % 16 == 0, "insert: k_pe must be 16-byte aligned");
  TORCH_CHECK_VALUE(addr(p.index_k) % 16 == 0, "insert: index_k must be 16-byte aligned");
  translate_errors([&] { pcpkv::validate_insert_shape(p); });
  const cudaStream_t stream = current_stream(a.mla_cache.device());
  translate_errors([&] {
    pcpkv::cuda::launch_insert_mla(&p, 1, stream);
    if (p.fmt.has_indexer) pcpkv::cuda::launch_insert_indexer(&p, 1, stream);
  });
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) { m.impl("insert", kernel<kInsert, &insert_cpu>()); }
#ifdef PCPKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(pcpkv, CUDA, m) { m.impl("insert", kernel<kInsert, &insert_cuda>()); }
#endif

}  // namespace pcpkv_torch
