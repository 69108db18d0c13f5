#include "support/publish_case.h"

#include <fmt/format.h>

#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/publish/checks.h"
#include "support/bytes.h"

namespace pcpkv::test {

std::unique_ptr<PublishCase> make_case(const CaseSpec& spec) {
  auto c = std::make_unique<PublishCase>();
  c->model = preset(spec.model);
  PlanConfig pc;
  pc.pcp_world = spec.pcp;
  pc.block_size = spec.block_size;
  pc.requests = spec.requests;
  pc.extra_blocks = spec.extra_blocks;
  pc.seed = spec.seed;
  pc.local_order = spec.local_order;
  pc.decode_ownership = spec.decode_ownership;
  c->plan = make_plan(pc);
  c->inputs = generate_inputs(c->model, c->plan, spec.fmt.has_indexer, spec.seed);
  c->setup.model = &c->model;
  c->setup.plan = &c->plan;
  c->setup.fmt = spec.fmt;
  c->setup.alloc = spec.alloc;
  c->setup.topk_width = spec.topk_width;
  c->setup.topk_fill_mode = spec.topk_fill;
  return c;
}

std::string describe_mla_offset(const PublishResult& r, const CacheFormat& fmt, int64_t off) {
  const MlaCacheGeometry& g = r.mla_geometry;
  const int64_t rel = off - r.mla_cache_offset;
  if (rel < 0) return "before the cache (guard / base offset)";
  if (rel >= g.bytes()) return "after the cache (guard)";
  const int64_t block = rel / g.block_stride, in_block = rel % g.block_stride;
  if (in_block >= int64_t{g.block_size} * g.row_stride) return fmt::format("padding of block {}", block);
  const int64_t row = in_block / g.row_stride, b = in_block % g.row_stride;
  const int64_t slot = block * g.block_size + row;
  if (b >= mla_row_bytes(fmt.kv_format)) return fmt::format("slot {} row padding byte {}", slot, b);
  std::string field;
  switch (fmt.kv_format) {
    case KvFormat::kBf16: field = b < 1024 ? fmt::format("kv_c[{}]", b / 2) : fmt::format("k_pe[{}]", (b - 1024) / 2); break;
    case KvFormat::kFp8: field = b < 512 ? fmt::format("kv_c[{}]", b) : fmt::format("k_pe[{}]", b - 512); break;
    case KvFormat::kFp8DsMla:
      field = b < 512 ? fmt::format("kv_c[{}] (tile {})", b, b / 128)
                      : (b < 528 ? fmt::format("tile scale {} byte {}", (b - 512) / 4, (b - 512) % 4)
                                 : fmt::format("k_pe[{}] (bf16)", (b - 528) / 2));
      break;
  }
  return fmt::format("slot {} (block {} row {}) row byte {}: {}", slot, block, row, b, field);
}

std::string describe_index_offset(const PublishResult& r, int64_t off) {
  const IndexerCacheGeometry& g = r.index_geometry;
  const int64_t rel = off - r.index_cache_offset;
  if (rel < 0) return "before the cache (guard / base offset)";
  if (rel >= g.bytes()) return "after the cache (guard)";
  const int64_t block = rel / g.block_stride, in_block = rel % g.block_stride;
  const int64_t data_bytes = int64_t{g.block_size} * kIndexHeadDim;
  if (in_block < data_bytes)
    return fmt::format("slot {} indexer data[{}]", block * g.block_size + in_block / kIndexHeadDim,
                       in_block % kIndexHeadDim);
  if (in_block < int64_t{g.block_size} * kIndexerSlotBytes)
    return fmt::format("slot {} indexer scale byte {}", block * g.block_size + (in_block - data_bytes) / 4,
                       (in_block - data_bytes) % 4);
  return fmt::format("padding of indexer block {}", block);
}

::testing::AssertionResult same_caches(const PublishResult& expected, const PublishResult& actual,
                                       const CacheFormat& fmt, const std::string& what) {
  if (expected.mla_alloc.size() != actual.mla_alloc.size())
    return ::testing::AssertionFailure() << what << ": " << expected.mla_alloc.size() << " vs "
                                         << actual.mla_alloc.size() << " replicas";
  for (size_t r = 0; r < expected.mla_alloc.size(); ++r) {
    auto m = bytes_equal(expected.mla_alloc[r], actual.mla_alloc[r], fmt::format("{}: rank {} mla cache", what, r),
                         [&](int64_t o) { return describe_mla_offset(actual, fmt, o); });
    if (!m) return m;
    auto i = bytes_equal(expected.index_alloc[r], actual.index_alloc[r],
                         fmt::format("{}: rank {} indexer cache", what, r),
                         [&](int64_t o) { return describe_index_offset(actual, o); });
    if (!i) return i;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult replicas_identical(const PublishResult& r, const CacheFormat& fmt) {
  for (size_t k = 1; k < r.mla_alloc.size(); ++k) {
    auto m = bytes_equal(r.mla_alloc[0], r.mla_alloc[k], fmt::format("rank {} mla cache vs rank 0", k),
                         [&](int64_t o) { return describe_mla_offset(r, fmt, o); });
    if (!m) return m;
    auto i = bytes_equal(r.index_alloc[0], r.index_alloc[k], fmt::format("rank {} indexer cache vs rank 0", k),
                         [&](int64_t o) { return describe_index_offset(r, o); });
    if (!i) return i;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_rows(const PublishResult& a, int32_t ra, const PublishResult& b, int32_t rb,
                                     const PcpPlan& plan, const CacheFormat& fmt, const std::string& what) {
  const int64_t row_bytes = mla_row_bytes(fmt.kv_format);
  const uint8_t* am = a.mla_alloc[static_cast<size_t>(ra)].data() + a.mla_cache_offset;
  const uint8_t* bm = b.mla_alloc[static_cast<size_t>(rb)].data() + b.mla_cache_offset;
  const uint8_t* ai = a.index_alloc[static_cast<size_t>(ra)].data() + a.index_cache_offset;
  const uint8_t* bi = b.index_alloc[static_cast<size_t>(rb)].data() + b.index_cache_offset;
  int64_t num_bad = 0;
  std::string first;
  for (int64_t g = 0; g < plan.num_global_tokens(); ++g) {
    const int64_t s = plan.global_slots[static_cast<size_t>(g)];
    if (s < 0) continue;
    auto m = bytes_equal(am + a.mla_geometry.row_offset(s), bm + b.mla_geometry.row_offset(s), row_bytes,
                         fmt::format("token {} slot {} MLA row", g, s));
    ::testing::AssertionResult i = ::testing::AssertionSuccess();
    if (m && fmt.has_indexer) {
      i = bytes_equal(ai + a.index_geometry.data_offset(s), bi + b.index_geometry.data_offset(s), kIndexHeadDim,
                      fmt::format("token {} slot {} indexer data", g, s));
      if (i)
        i = bytes_equal(ai + a.index_geometry.scale_offset(s), bi + b.index_geometry.scale_offset(s), 4,
                        fmt::format("token {} slot {} indexer scale", g, s));
    }
    if (!m || !i) {
      if (num_bad++ == 0) first = !m ? m.message() : i.message();
    }
  }
  if (num_bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << num_bad << " rows differ; first: " << first;
}

::testing::AssertionResult all_untouched(const PublishResult& r, const PcpPlan& plan, const CacheFormat& fmt) {
  for (int32_t rank = 0; rank < static_cast<int32_t>(r.mla_alloc.size()); ++rank) {
    const GuardReport g = check_untouched(r, rank, plan, fmt);
    if (g.num_bad != 0)
      return ::testing::AssertionFailure() << g.num_bad << " bytes outside written rows changed; first: " << g.first;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace pcpkv::test
