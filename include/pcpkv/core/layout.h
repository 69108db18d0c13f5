// pcpkv/core/layout.h: byte layouts of the caches, the transport rows and the staging workspace (SPEC 3).
// Every offset is computed in 64 bits: slot * row_bytes overflows 32 bits in real caches.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace pcpkv {

/// MLA cache row format (SPEC section 3).
enum class KvFormat : uint8_t {
  kBf16,      // 1152 B: kv_c 512 bf16 | k_pe 64 bf16
  kFp8,       //  576 B: kv_c 512 e4m3 | k_pe 64 e4m3, both x / k_scale
  kFp8DsMla,  //  656 B: kv_c 512 e4m3 (4 tiles of 128) | 4 fp32 tile scales | k_pe 64 bf16
};
/// fp8_ds_mla tile scale rule: kPow2 (current vLLM / FlashMLA) or kRaw (older vLLM writers).
enum class DsMlaScale : uint8_t { kPow2, kRaw };

const char* to_string(KvFormat f);
const char* to_string(DsMlaScale s);
/// Parses "bf16" | "fp8" | "fp8_ds_mla"; throws pcpkv::Error naming `field` and the value.
KvFormat parse_kv_format(const std::string& s, const char* field = "kv-format");
DsMlaScale parse_ds_mla_scale(const std::string& s, const char* field = "ds-mla-scale");

constexpr int64_t kKvLoraRank = 512;
constexpr int64_t kRopeDims = 64;
constexpr int64_t kIndexHeadDim = 128;
constexpr int64_t kDsMlaTile = 128;
constexpr int64_t kIndexerSlotBytes = 132;  // 128 e4m3 + fp32 scale

/// Bytes of one MLA cache row: 1152, 576 or 656.
constexpr int64_t mla_row_bytes(KvFormat f) {
  return f == KvFormat::kBf16 ? 1152 : (f == KvFormat::kFp8 ? 576 : 656);
}

/// What one layer writes: format of the MLA row, scale rule, static scale, and whether it has an indexer.
struct CacheFormat {
  KvFormat kv_format = KvFormat::kFp8DsMla;
  DsMlaScale ds_mla_scale = DsMlaScale::kPow2;
  float k_scale = 1.0f;      // per-tensor scale of the static fp8 format (x / k_scale); scale_problem() is empty
  bool has_indexer = true;   // false: "shared" layer (IndexShare) with no indexer K
};

/// Why `scale` cannot be the static fp8 k_scale (SPEC section 3: the cache stores x / k_scale as E4M3, and the
/// kernels divide in float32), or nullopt when it can: it must lie in the normal float32 range
/// [2^-126 (FLT_MIN), FLT_MAX], so its float32 is finite, positive and normal. Refused: 0, negatives, nan, inf,
/// values beyond FLT_MAX (inf as float32), and subnormals: x / a subnormal k_scale is inf for every |x| > 2^-21
/// (x / 2^-149 overflows), and flush-to-zero arithmetic reads the scale as 0. The one rule of every reader
/// (validate_cache_format, the CLI's --k-scale, pcpkv_torch's make_format and its Python scale_problem); sparse
/// MLA's softmax_scale, the other float32 scale callers give as a double, follows it too (sparse_mla_softmax_scale).
/// The text starts with "must be"; callers name the field and the value: "fmt.k_scale = 1e-45 must be ...".
std::optional<std::string> scale_problem(double scale);

// ---- fp8_ds_mla row offsets ----------------------------------------------------------------------
constexpr int64_t kDsMlaKvcOffset = 0;      // 512 e4m3
constexpr int64_t kDsMlaScaleOffset = 512;  // 4 fp32, little-endian
constexpr int64_t kDsMlaKpeOffset = 528;    // 64 bf16

/// Paged MLA cache geometry: [num_blocks, block_size, row] with real strides, in bytes.
/// Row of slot s: base + (s / block_size) * block_stride + (s % block_size) * row_stride.
struct MlaCacheGeometry {
  int64_t num_blocks = 0;
  int32_t block_size = 0;     // tokens per block, power of two
  int64_t row_stride = 0;     // bytes between rows of one block, >= mla_row_bytes
  int64_t block_stride = 0;   // bytes between blocks, >= block_size * row_stride
  int64_t num_slots() const { return num_blocks * block_size; }
  int64_t row_offset(int64_t slot) const {
    return (slot / block_size) * block_stride + (slot % block_size) * row_stride;
  }
  int64_t bytes() const { return num_blocks * block_stride; }
};

/// Indexer-K cache geometry (vLLM DeepseekV32IndexerCache, SPEC section 3): per block, block_size rows of
/// 128 e4m3, then block_size fp32 scales; block_stride defaults to block_size * 132 and may be padded.
struct IndexerCacheGeometry {
  int64_t num_blocks = 0;
  int32_t block_size = 0;
  int64_t block_stride = 0;
  int64_t num_slots() const { return num_blocks * block_size; }
  int64_t data_offset(int64_t slot) const {
    return (slot / block_size) * block_stride + (slot % block_size) * kIndexHeadDim;
  }
  int64_t scale_offset(int64_t slot) const {
    return (slot / block_size) * block_stride + int64_t{block_size} * kIndexHeadDim + (slot % block_size) * 4;
  }
  int64_t bytes() const { return num_blocks * block_stride; }
};

/// Dense geometries (row_stride = row bytes, block_stride = block_size * row bytes / * 132).
MlaCacheGeometry dense_mla_geometry(KvFormat f, int64_t num_blocks, int32_t block_size);
IndexerCacheGeometry dense_indexer_geometry(int64_t num_blocks, int32_t block_size);
/// Largest cache a geometry may describe (256 TiB): bounds num_blocks * block_stride and
/// block_size * row_stride so every row offset fits in int64.
constexpr int64_t kMaxCacheBytes = int64_t{1} << 48;
/// Throws pcpkv::Error naming the field if a geometry cannot hold rows of format f (stride too small,
/// block_size not a power of two, negative sizes, scale region misaligned, more than kMaxCacheBytes).
void validate_geometry(const MlaCacheGeometry& g, KvFormat f);
void validate_geometry(const IndexerCacheGeometry& g);

/// Transport row (SPEC section 3): [MLA cache row | indexer K 128 e4m3 | indexer scale fp32 | pad 12].
/// fp8 + indexer = 720 B, fp8_ds_mla + indexer = 800 B, bf16 + indexer = 1296 B; without an indexer the
/// row is the MLA row alone (576 / 656 / 1152 B).
struct TransportRowLayout {
  int64_t mla_bytes = 0;        // bytes [0, mla_bytes) are the MLA cache row, byte for byte
  int64_t index_data_offset = -1;   // -1 when the layer has no indexer
  int64_t index_scale_offset = -1;
  int64_t row_bytes = 0;        // multiple of 16
};
TransportRowLayout transport_row_layout(const CacheFormat& fmt);

/// Staging workspace (SPEC section 3), per rank, symmetric:
/// [2 (double buffer)][num_ubatches][pcp_world][max_local_tokens][row_bytes].
struct StagingGeometry {
  int32_t num_ubatches = 1;
  int32_t pcp_world = 1;
  int64_t max_local_tokens = 0;
  int64_t row_bytes = 0;
  int64_t bytes() const { return 2 * int64_t{num_ubatches} * pcp_world * max_local_tokens * row_bytes; }
  /// Offset of the row of (buffer, ubatch, source rank src_rank, local token token_idx).
  int64_t row_offset(int buffer, int ubatch, int src_rank, int64_t token_idx) const {
    return (((int64_t{buffer} * num_ubatches + ubatch) * pcp_world + src_rank) * max_local_tokens + token_idx) *
           row_bytes;
  }
};

}  // namespace pcpkv
