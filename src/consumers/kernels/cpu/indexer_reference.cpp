// CPU reference of the DSA indexer (SPEC section 6): scores in the fixed order of
// pcpkv/device/consumers.h and an exact top-k by (score desc, position asc).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "core/parallel.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/consumers.h"
#include "pcpkv/core/error.h"
#include "pcpkv/consumers/indexer.h"

namespace pcpkv {

const char* to_string(IndexerLogit l) {
  switch (l) {
    case IndexerLogit::kExact: return "exact";
    case IndexerLogit::kFp32Tree: return "fp32_tree";
  }
  return "?";
}

float index_weight_scale(int32_t num_heads) {
  PCPKV_CHECK(num_heads >= 1, "indexer: num_heads must be >= 1, got {}", num_heads);
  return static_cast<float>(1.0 / std::sqrt(128.0 * static_cast<double>(num_heads)));
}

void quantize_index_queries(const uint16_t* q, int64_t num_tokens, int32_t num_heads, uint8_t* q_fp8,
                            float* q_scale) {
  PCPKV_CHECK(num_tokens >= 0, "quantize_index_queries: num_tokens must be >= 0, got {}", num_tokens);
  PCPKV_CHECK(num_heads >= 1, "quantize_index_queries: num_heads must be >= 1, got {}", num_heads);
  PCPKV_CHECK(num_tokens == 0 || (q && q_fp8 && q_scale), "quantize_index_queries: null pointer");
  const int64_t rows = num_tokens * num_heads;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* x = q + r * kIndexHeadDim;
    float v[kIndexHeadDim];
    float amax = 0.0f;
    for (int d = 0; d < kIndexHeadDim; ++d) {
      v[d] = codec::bf16_to_float(x[d]);
      amax = fp32::amax(amax, fp32::abs(v[d]));
    }
    const float s = codec::indexer_scale(amax);
    q_scale[r] = s;
    for (int d = 0; d < kIndexHeadDim; ++d) q_fp8[r * kIndexHeadDim + d] = codec::quantize_e4m3(v[d], s);
  }
}

void validate_indexer_scalars(const IndexerParams& p) {
  PCPKV_CHECK(p.num_tokens >= 0, "indexer: num_tokens must be >= 0, got {}", p.num_tokens);
  PCPKV_CHECK(p.num_heads >= 1 && p.num_heads <= 128, "indexer: num_heads must be in [1, 128], got {}",
              p.num_heads);
  PCPKV_CHECK(p.topk >= 1 && p.topk <= 8192, "indexer: topk must be in [1, 8192], got {}", p.topk);
  PCPKV_CHECK(p.logit == IndexerLogit::kExact || p.logit == IndexerLogit::kFp32Tree,
              "indexer: logit must be kExact or kFp32Tree, got {}", static_cast<int>(p.logit));
  validate_geometry(p.geometry);
}

void validate_indexer(const IndexerParams& p) {
  validate_indexer_scalars(p);
  PCPKV_CHECK(p.geometry.num_slots() <= (int64_t{1} << 31),
              "indexer: geometry has {} slots; int32 slot indices hold at most 2^31", p.geometry.num_slots());
  PCPKV_CHECK(p.num_requests >= 0, "indexer: num_requests must be >= 0, got {}", p.num_requests);
  PCPKV_CHECK(p.block_table_stride >= 0, "indexer: block_table_stride must be >= 0, got {}",
              p.block_table_stride);
  if (p.num_tokens == 0) return;
  PCPKV_CHECK(p.q_fp8 && p.q_scale && p.weights && p.positions && p.request_idx && p.topk_slots,
              "indexer: q_fp8, q_scale, weights, positions, request_idx and topk_slots must be non-null");
  PCPKV_CHECK(p.index_cache, "indexer: index_cache must be non-null");
  PCPKV_CHECK(p.max_keys >= 1 && p.max_keys < (int64_t{1} << 31),
              "indexer: max_keys must be in [1, 2^31), got {}", p.max_keys);
  const int64_t bs = p.geometry.block_size;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int32_t req = p.request_idx[t];
    if (req == -1) continue;
    PCPKV_CHECK(req >= 0 && req < p.num_requests, "indexer: request_idx[{}] = {} is out of range [-1, {})", t,
                req, p.num_requests);
    const int64_t pos = p.positions[t];
    PCPKV_CHECK(pos >= 0 && pos < p.max_keys, "indexer: positions[{}] = {} is out of range [0, max_keys = {})",
                t, pos, p.max_keys);
    const int64_t blocks = pos / bs + 1;
    PCPKV_CHECK(blocks <= p.block_table_stride,
                "indexer: positions[{}] = {} needs {} blocks but block_table_stride is {}", t, pos, blocks,
                p.block_table_stride);
    PCPKV_CHECK(p.block_tables, "indexer: block_tables must be non-null");
    const int32_t* table = p.block_tables + int64_t{req} * p.block_table_stride;
    for (int64_t b = 0; b < blocks; ++b)
      PCPKV_CHECK(table[b] >= 0 && table[b] < p.geometry.num_blocks,
                  "indexer: block_tables[{}, {}] = {} is out of range [0, {})", req, b, table[b],
                  p.geometry.num_blocks);
  }
}

namespace {

float load_scale(const uint8_t* p) {
  float s;
  std::memcpy(&s, p, 4);
  return s;
}

}  // namespace

void indexer_reference(const IndexerParams& p) {
  validate_indexer(p);
  const int H = p.num_heads;
  const int64_t bs = p.geometry.block_size;
  const float c = index_weight_scale(H);
  // Tokens are independent: split them over threads (results do not depend on the split).
  const int num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_detail::parallel_for(p.num_tokens, num_threads, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> q(static_cast<size_t>(H) * kIndexHeadDim), w(H);
    std::vector<uint64_t> keys;
    for (int64_t t = t_begin; t < t_end; ++t) {
      int32_t* out_slots = p.topk_slots + t * p.topk;
      int32_t* out_pos = p.topk_positions ? p.topk_positions + t * p.topk : nullptr;
      std::fill(out_slots, out_slots + p.topk, -1);
      if (out_pos) std::fill(out_pos, out_pos + p.topk, -1);
      const int32_t req = p.request_idx[t];
      if (req < 0) continue;
      const int64_t len = p.positions[t] + 1;
      const int32_t* table = p.block_tables + int64_t{req} * p.block_table_stride;
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < kIndexHeadDim; ++d)
          q[h * kIndexHeadDim + d] = codec::e4m3_to_float(p.q_fp8[(t * H + h) * kIndexHeadDim + d]);
        w[h] = consumers::index_head_weight(p.weights[t * H + h], c, p.q_scale[t * H + h]);
      }
      keys.resize(len);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t slot = int64_t{table[j / bs]} * bs + j % bs;
        const uint8_t* kb = p.index_cache + p.geometry.data_offset(slot);
        float k[kIndexHeadDim];
        for (int d = 0; d < kIndexHeadDim; ++d) k[d] = codec::e4m3_to_float(kb[d]);
        const bool exact = p.logit == IndexerLogit::kExact;
        const float score = consumers::index_score(
            H, load_scale(p.index_cache + p.geometry.scale_offset(slot)), [&](int h) {
              const float* qh = &q[h * kIndexHeadDim];
              return consumers::index_term(
                  exact ? consumers::index_logit_exact(qh, k) : consumers::index_logit_tree(qh, k), w[h]);
            });
        if (p.scores) p.scores[t * p.max_keys + j] = score;
        keys[j] = consumers::sort_key(score, j);
      }
      // Unique keys: the k largest, in descending order, are the contract's top-k exactly.
      const int64_t k = std::min<int64_t>(p.topk, len);
      std::partial_sort(keys.begin(), keys.begin() + k, keys.end(), std::greater<uint64_t>());
      for (int64_t i = 0; i < k; ++i) {
        const int64_t j = consumers::sort_key_position(keys[i]);
        out_slots[i] = static_cast<int32_t>(int64_t{table[j / bs]} * bs + j % bs);
        if (out_pos) out_pos[i] = static_cast<int32_t>(j);
      }
    }
  }, 4);
}

}  // namespace pcpkv
