// Byte layouts (SPEC section 3): names, dense geometries, validation, transport rows.
#include "pcpkv/core/layout.h"

#include <cfloat>

#include "pcpkv/core/block_size.h"

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv {

const char* to_string(KvFormat f) {
  switch (f) {
    case KvFormat::kBf16: return "bf16";
    case KvFormat::kFp8: return "fp8";
    case KvFormat::kFp8DsMla: return "fp8_ds_mla";
  }
  return "?";
}

const char* to_string(DsMlaScale s) { return s == DsMlaScale::kPow2 ? "pow2" : "raw"; }

KvFormat parse_kv_format(const std::string& s, const char* field) {
  if (s == "bf16") return KvFormat::kBf16;
  if (s == "fp8" || s == "fp8_e4m3") return KvFormat::kFp8;
  if (s == "fp8_ds_mla") return KvFormat::kFp8DsMla;
  PCPKV_FAIL("--{}: unknown kv cache format '{}'; known: bf16, fp8, fp8_ds_mla", field, clip(s));
}

DsMlaScale parse_ds_mla_scale(const std::string& s, const char* field) {
  if (s == "pow2") return DsMlaScale::kPow2;
  if (s == "raw") return DsMlaScale::kRaw;
  PCPKV_FAIL("--{}: unknown fp8_ds_mla scale rule '{}'; known: pow2, raw", field, clip(s));
}

std::optional<std::string> scale_problem(double scale) {
  // On the value given, as Python's scale_problem: nan fails both comparisons, and every double in the range rounds
  // to a normal, finite float32 (the few just outside that would round into it are refused too).
  if (scale >= static_cast<double>(FLT_MIN) && scale <= static_cast<double>(FLT_MAX)) return std::nullopt;
  return std::string(
      "must be a finite, positive, normal float32 (in [2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, "
      "nan and inf are refused)");
}

std::optional<std::string> block_size_problem(int64_t block_size) {
  if (block_size > 0 && (block_size & (block_size - 1)) == 0 && (block_size * kIndexerSlotBytes) % 16 == 0)
    return std::nullopt;
  return std::string(
      "must be a power of two >= 4 (slot = block_id * block_size + offset; an indexer-K cache block holds "
      "block_size * 132 bytes, which must be a multiple of 16)");
}

MlaCacheGeometry dense_mla_geometry(KvFormat f, int64_t num_blocks, int32_t block_size) {
  MlaCacheGeometry g;
  g.num_blocks = num_blocks;
  g.block_size = block_size;
  g.row_stride = mla_row_bytes(f);
  g.block_stride = g.row_stride * block_size;
  return g;
}

IndexerCacheGeometry dense_indexer_geometry(int64_t num_blocks, int32_t block_size) {
  IndexerCacheGeometry g;
  g.num_blocks = num_blocks;
  g.block_size = block_size;
  g.block_stride = int64_t{block_size} * kIndexerSlotBytes;
  return g;
}

namespace {
bool is_pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }
}  // namespace

void validate_geometry(const MlaCacheGeometry& g, KvFormat f) {
  PCPKV_CHECK(g.num_blocks >= 1, "mla cache: num_blocks = {} must be >= 1", g.num_blocks);
  PCPKV_CHECK(is_pow2(g.block_size), "mla cache: block_size = {} must be a power of two", g.block_size);
  PCPKV_CHECK(g.row_stride >= mla_row_bytes(f), "mla cache: row_stride = {} B is smaller than a {} row ({} B)",
              g.row_stride, to_string(f), mla_row_bytes(f));
  // fp32 tile scales and bf16 values need their natural alignment; 16 B keeps rows vector-aligned.
  PCPKV_CHECK(g.row_stride % 16 == 0, "mla cache: row_stride = {} B must be a multiple of 16", g.row_stride);
  // Bounded before any product: every offset inside bytes() then fits in int64 (hostile sizes from a table).
  PCPKV_CHECK(g.row_stride <= kMaxCacheBytes / g.block_size,
              "mla cache: row_stride = {} B times block_size = {} exceeds {} B", g.row_stride, g.block_size,
              kMaxCacheBytes);
  PCPKV_CHECK(g.block_stride >= g.row_stride * g.block_size,
              "mla cache: block_stride = {} B is smaller than block_size * row_stride = {} B", g.block_stride,
              g.row_stride * g.block_size);
  PCPKV_CHECK(g.block_stride % 16 == 0, "mla cache: block_stride = {} B must be a multiple of 16", g.block_stride);
  PCPKV_CHECK(g.block_stride <= kMaxCacheBytes / g.num_blocks,
              "mla cache: num_blocks = {} times block_stride = {} B exceeds {} B", g.num_blocks, g.block_stride,
              kMaxCacheBytes);
}

void validate_geometry(const IndexerCacheGeometry& g) {
  PCPKV_CHECK(g.num_blocks >= 1, "indexer cache: num_blocks = {} must be >= 1", g.num_blocks);
  PCPKV_CHECK(is_pow2(g.block_size), "indexer cache: block_size = {} must be a power of two", g.block_size);
  PCPKV_CHECK(g.block_stride >= int64_t{g.block_size} * kIndexerSlotBytes,
              "indexer cache: block_stride = {} B is smaller than block_size * 132 = {} B", g.block_stride,
              int64_t{g.block_size} * kIndexerSlotBytes);
  PCPKV_CHECK(g.block_stride % 16 == 0, "indexer cache: block_stride = {} B must be a multiple of 16",
              g.block_stride);
  PCPKV_CHECK(g.block_stride <= kMaxCacheBytes / g.num_blocks,
              "indexer cache: num_blocks = {} times block_stride = {} B exceeds {} B", g.num_blocks, g.block_stride,
              kMaxCacheBytes);
}

TransportRowLayout transport_row_layout(const CacheFormat& fmt) {
  TransportRowLayout l;
  l.mla_bytes = mla_row_bytes(fmt.kv_format);
  if (fmt.has_indexer) {
    l.index_data_offset = l.mla_bytes;
    l.index_scale_offset = l.mla_bytes + kIndexHeadDim;
    l.row_bytes = l.mla_bytes + kIndexHeadDim + 4 + 12;  // 720 / 800 / 1296
  } else {
    l.row_bytes = l.mla_bytes;  // 576 / 656 / 1152, all multiples of 16
  }
  return l;
}

}  // namespace pcpkv
