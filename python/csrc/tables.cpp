// python/csrc/tables.cpp: the host-only ops of pcpkv_torch/tables.py (schemas: registry.cpp): make_cache_targets (a
// target table of pcpkv::CacheTarget records) and the overlap checks first_overlap / first_range_overlap, over the one
// overlap rule pcpkv::first_overlap (pcpkv/core/byte_range.h).
#include <ATen/Functions.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "pcpkv/publish/cpu.h"

namespace pcpkv_torch {
namespace {

at::Tensor make_cache_targets(const at::Tensor& mla_ptrs, const at::Tensor& index_ptrs, int64_t num_blocks,
                              int64_t block_size, int64_t row_stride, int64_t block_stride, int64_t index_block_stride,
                              c10::string_view kv_format, bool has_indexer, int64_t index_num_blocks) {
  const pcpkv::CacheFormat fmt = make_format(std::string(kv_format), "pow2", 1.0, has_indexer);
  const std::vector<uint8_t*> mla = read_pointer_table(mla_ptrs, "make_cache_targets: mla_ptrs");
  const std::vector<uint8_t*> idx = read_pointer_table(index_ptrs, "make_cache_targets: index_ptrs");
  TORCH_CHECK_VALUE(!mla.empty(), "make_cache_targets: mla_ptrs is empty; expected one pointer per replica");
  TORCH_CHECK_VALUE(!has_indexer || idx.size() == mla.size(), "make_cache_targets: ", mla.size(),
                    " MLA pointers but ", idx.size(), " indexer pointers");
  at::Tensor out = at::zeros({static_cast<int64_t>(mla.size()), kTargetRecordBytes}, at::kByte);
  auto* rec = reinterpret_cast<pcpkv::CacheTarget*>(out.data_ptr());
  translate_errors([&] {
    for (size_t d = 0; d < mla.size(); ++d) {
      pcpkv::CacheTarget t;
      t.mla_base = mla[d];
      t.mla.num_blocks = num_blocks;
      t.mla.block_size = static_cast<int32_t>(block_size);
      t.mla.row_stride = row_stride;
      t.mla.block_stride = block_stride;
      if (has_indexer) {
        t.index_base = idx[d];
        t.index.num_blocks = index_num_blocks < 0 ? num_blocks : index_num_blocks;  // its own (spec 4.2), or the MLA's
        t.index.block_size = static_cast<int32_t>(block_size);
        t.index.block_stride = index_block_stride;
      }
      pcpkv::validate_cache_target(t, fmt, fmt::format("make_cache_targets: target {}", d).c_str());
      rec[d] = t;
    }
  });
  return out;
}

std::vector<int64_t> as_list(const std::optional<std::pair<size_t, size_t>>& hit) {
  if (!hit) return {};
  return {static_cast<int64_t>(hit->first), static_cast<int64_t>(hit->second)};
}

// first_overlap (csrc/checks.h, over pcpkv::first_overlap) for the Python entry points that name their own
// arguments: [] or [i, j].
std::vector<int64_t> first_overlap_op(at::TensorList writes, at::TensorList reads, bool writes_pairwise) {
  return as_list(first_overlap(writes.vec(), reads.vec(), writes_pairwise));
}

// first_overlap of the entries of one pointer table (Python's CacheTargets / RowDests constructors): entry i spans
// [ptrs[i], ptrs[i] + sizes[i]) of the table's one address space; every pair is compared. [] or [i, j].
std::vector<int64_t> first_range_overlap(const at::Tensor& ptrs, at::IntArrayRef sizes) {
  const std::vector<uint8_t*> p = read_pointer_table(ptrs, "first_range_overlap: ptrs");
  TORCH_CHECK_VALUE(sizes.size() == p.size(), "first_range_overlap: ", p.size(), " pointers but ", sizes.size(),
                    " sizes");
  std::vector<ByteRange> r(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    TORCH_CHECK_VALUE(sizes[i] >= 0, "first_range_overlap: sizes[", i, "] = ", sizes[i], " is negative");
    r[i] = pcpkv::byte_range(p[i], static_cast<uint64_t>(sizes[i]));  // saturated: it still covers its bytes
  }
  return as_list(pcpkv::first_overlap(r, {}, true));
}

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CompositeImplicitAutograd, m) {
  m.impl("make_cache_targets", &make_cache_targets);
  m.impl("first_overlap", &first_overlap_op);
  m.impl("first_range_overlap", &first_range_overlap);
}

}  // namespace pcpkv_torch
