// Byte comparisons of pcpkv/publish/checks.h: buffers against each other or against the guard byte, and where
// a byte of a replica's MLA / indexer allocation lies (slot, field), which every first-difference message names.
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "pcpkv/core/error.h"
#include "pcpkv/publish/checks.h"

namespace pcpkv {

// ---- compare_bytes ---------------------------------------------------------------------------------

ByteDiff compare_bytes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  PCPKV_CHECK(a.size() == b.size(), "compare_bytes: sizes differ ({} B vs {} B)", a.size(), b.size());
  return compare_bytes(a.data(), b.data(), static_cast<int64_t>(a.size()));
}

ByteDiff compare_bytes(const void* pa, const void* pb, int64_t n) {
  PCPKV_CHECK(n >= 0, "compare_bytes: n is {}, must be >= 0", n);
  const auto* a = static_cast<const uint8_t*>(pa);
  const auto* b = static_cast<const uint8_t*>(pb);
  ByteDiff d;
  constexpr int64_t kChunk = 4096;  // memcmp finds equal chunks fast; only differing ones are walked
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t len = std::min(kChunk, n - begin);
    if (std::memcmp(a + begin, b + begin, static_cast<size_t>(len)) == 0) continue;
    for (int64_t i = begin; i < begin + len; ++i)
      if (a[i] != b[i]) {
        if (d.first_diff < 0) d.first_diff = i;
        ++d.num_diff;
      }
  }
  return d;
}

ByteDiff compare_to_guard(const void* pp, int64_t n) {
  PCPKV_CHECK(n >= 0, "compare_to_guard: n is {}, must be >= 0", n);
  const auto* p = static_cast<const uint8_t*>(pp);
  ByteDiff d;
  for (int64_t i = 0; i < n; ++i)
    if (p[i] != kGuardByte) {
      if (d.first_diff < 0) d.first_diff = i;
      ++d.num_diff;
    }
  return d;
}

// ---- describe_mla_byte, describe_index_byte ------------------------------------------------------------

namespace {

// The field of byte b of an MLA row (SPEC section 3 layouts).
std::string mla_field(KvFormat f, int64_t b) {
  switch (f) {
    case KvFormat::kBf16:
      return b < 1024 ? fmt::format("kv_c[{}] (bf16)", b / 2) : fmt::format("k_pe[{}] (bf16)", (b - 1024) / 2);
    case KvFormat::kFp8:
      return b < 512 ? fmt::format("kv_c[{}]", b) : fmt::format("k_pe[{}]", b - 512);
    case KvFormat::kFp8DsMla:
      if (b < kDsMlaScaleOffset) return fmt::format("kv_c[{}], tile {}", b, b / kDsMlaTile);
      if (b < kDsMlaKpeOffset)
        return fmt::format("tile {} scale, byte {}", (b - kDsMlaScaleOffset) / 4, (b - kDsMlaScaleOffset) % 4);
      return fmt::format("k_pe[{}] (bf16)", (b - kDsMlaKpeOffset) / 2);
  }
  return "?";
}

}  // namespace

std::string describe_mla_byte(const PublishResult& r, const CacheFormat& fmt, int64_t off) {
  const MlaCacheGeometry& g = r.mla_geometry;
  const int64_t rel = off - r.mla_cache_offset;
  if (rel < 0) return fmt::format("byte {} (before the cache)", off);
  if (rel >= g.bytes()) return fmt::format("byte {} (after the cache)", off);
  const int64_t block = rel / g.block_stride, in_block = rel % g.block_stride;
  const int64_t row = in_block / g.row_stride, b = in_block % g.row_stride;
  if (row >= g.block_size) return fmt::format("byte {} (block {} padding)", off, block);
  const int64_t slot = block * g.block_size + row;
  if (b >= mla_row_bytes(fmt.kv_format))
    return fmt::format("byte {} (slot {}, byte {} of its row: row padding)", off, slot, b);
  return fmt::format("byte {} (slot {}, byte {} of its row: {}; block {} row {})", off, slot, b,
                     mla_field(fmt.kv_format, b), block, row);
}

std::string describe_index_byte(const PublishResult& r, int64_t off) {
  const IndexerCacheGeometry& g = r.index_geometry;
  const int64_t rel = off - r.index_cache_offset;
  if (rel < 0) return fmt::format("byte {} (before the cache)", off);
  if (rel >= g.bytes()) return fmt::format("byte {} (after the cache)", off);
  const int64_t block = rel / g.block_stride, in_block = rel % g.block_stride;
  const int64_t data_bytes = int64_t{g.block_size} * kIndexHeadDim;
  if (in_block < data_bytes) {
    return fmt::format("byte {} (slot {} data, byte {})", off, block * g.block_size + in_block / kIndexHeadDim,
                       in_block % kIndexHeadDim);
  }
  if (in_block < data_bytes + int64_t{g.block_size} * 4) {
    return fmt::format("byte {} (slot {} scale, byte {})", off, block * g.block_size + (in_block - data_bytes) / 4,
                       (in_block - data_bytes) % 4);
  }
  return fmt::format("byte {} (block {} padding)", off, block);
}

}  // namespace pcpkv
