// tests/support/consumers_fixture.h: small seeded consumer problems (indexer, sparse MLA) shared by the
// CPU unit tests and the CUDA tests (tests/cuda includes it as "unit/test_consumers_fixture.h").
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "consumers/checks/attention_check_internal.h"
#include "pcpkv/consumers/attention_check.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/consumers/indexer.h"
#include "pcpkv/consumers/sparse_mla.h"

namespace pcpkv::test {

/// Requests of given lengths in a paged indexer cache with shuffled block tables and a padded block
/// stride; query tokens at the given positions of their requests (request -1: padding rows).
struct IndexerCase {
  int32_t num_heads = 8;
  int32_t block_size = 16;
  int32_t topk = 32;
  std::vector<int64_t> request_len;         // keys per request
  std::vector<int32_t> token_request;       // [T], -1 = padding
  std::vector<int64_t> token_position;      // [T]
  int64_t stride_pad = 48;                  // padded indexer block stride (bytes, multiple of 16)
  uint64_t seed = 7;

  // built by build()
  IndexerCacheGeometry geometry;
  std::vector<uint8_t> cache;
  std::vector<int32_t> tables;
  int64_t table_stride = 0;
  std::vector<uint8_t> q_fp8;
  std::vector<float> q_scale, weights;
  std::vector<int32_t> topk_slots, topk_pos;
  std::vector<float> scores;
  int64_t max_keys = 1;

  void build() {
    const int64_t T = static_cast<int64_t>(token_request.size());
    int64_t blocks = 0;
    for (int64_t len : request_len) {
      table_stride = std::max(table_stride, (len + block_size - 1) / block_size);
      blocks += (len + block_size - 1) / block_size;
      max_keys = std::max(max_keys, len);
    }
    geometry.num_blocks = blocks + 3;  // spare blocks stay poisoned
    geometry.block_size = block_size;
    geometry.block_stride = int64_t{block_size} * kIndexerSlotBytes + stride_pad;
    cache.assign(geometry.bytes(), 0xA5);
    // Shuffled block ids, block 0 never used (the null block).
    std::vector<int32_t> ids(geometry.num_blocks - 1);
    std::iota(ids.begin(), ids.end(), 1);
    attention_inputs::Rng rng{seed};
    for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[rng.next() % i]);
    tables.assign(request_len.size() * table_stride, -1);
    size_t next = 0;
    for (size_t r = 0; r < request_len.size(); ++r)
      for (int64_t b = 0; b * block_size < request_len[r]; ++b) tables[r * table_stride + b] = ids[next++];
    for (size_t r = 0; r < request_len.size(); ++r)
      for (int64_t j = 0; j < request_len[r]; ++j) {
        float k[128];
        attention_inputs::random_row(rng, k, 128, 1.0, 5);
        encode_key(static_cast<int32_t>(r), j, k);
      }
    std::vector<uint16_t> q(T * num_heads * 128);
    for (auto& v : q) v = 0;
    for (int64_t r = 0; r < T * num_heads; ++r) {
      float row[128];
      attention_inputs::random_row(rng, row, 128, 1.0, 1);
      for (int d = 0; d < 128; ++d) q[r * 128 + d] = codec::float_to_bf16(row[d]);
    }
    q_fp8.resize(q.size());
    q_scale.resize(T * num_heads);
    quantize_index_queries(q.data(), T, num_heads, q_fp8.data(), q_scale.data());
    weights.resize(T * num_heads);
    for (auto& w : weights) w = static_cast<float>(rng.normal());
  }
  int64_t slot(int32_t req, int64_t pos) const {
    return int64_t{tables[req * table_stride + pos / block_size]} * block_size + pos % block_size;
  }
  void encode_key(int32_t req, int64_t pos, const float* k) {
    const int64_t s = slot(req, pos);
    attention_inputs::encode_index_row(k, cache.data() + geometry.data_offset(s), cache.data() + geometry.scale_offset(s));
  }
  /// Copies key (req, from) over key (req, to): equal rows give equal scores (ties).
  void copy_key(int32_t req, int64_t from, int64_t to) {
    const int64_t a = slot(req, from), b = slot(req, to);
    std::memcpy(cache.data() + geometry.data_offset(b), cache.data() + geometry.data_offset(a), 128);
    std::memcpy(cache.data() + geometry.scale_offset(b), cache.data() + geometry.scale_offset(a), 4);
  }
  IndexerParams params() {
    const int64_t T = static_cast<int64_t>(token_request.size());
    topk_slots.assign(T * topk, 0x5a5a5a5a);
    topk_pos.assign(T * topk, 0x5a5a5a5a);
    scores.assign(T * max_keys, -12345.0f);
    IndexerParams p;
    p.num_tokens = T;
    p.num_heads = num_heads;
    p.q_fp8 = q_fp8.data();
    p.q_scale = q_scale.data();
    p.weights = weights.data();
    p.positions = token_position.data();
    p.request_idx = token_request.data();
    p.block_tables = tables.data();
    p.num_requests = static_cast<int32_t>(request_len.size());
    p.block_table_stride = table_stride;
    p.index_cache = cache.data();
    p.geometry = geometry;
    p.topk = topk;
    p.max_keys = max_keys;
    p.topk_slots = topk_slots.data();
    p.topk_positions = topk_pos.data();
    p.scores = scores.data();
    return p;
  }
};

/// A paged MLA cache of `num_slots` random rows (padded row and block strides) and T queries with index
/// rows drawn from the slots (with -1 entries mixed in).
struct AttentionCase {
  CacheFormat fmt;
  int32_t num_heads = 4;
  int64_t num_tokens = 3;
  int32_t topk = 40;
  int32_t block_size = 8;
  int64_t num_blocks = 12;
  int64_t row_pad = 16, block_pad = 64;
  double minus_one_rate = 0.2;  // fraction of index entries set to -1
  float softmax_scale = 0.0625f;
  uint64_t seed = 11;

  MlaCacheGeometry geometry;
  std::vector<uint8_t> cache;
  std::vector<uint16_t> q;
  std::vector<int32_t> indices;
  std::vector<float> out, lse;

  void build() {
    geometry.num_blocks = num_blocks;
    geometry.block_size = block_size;
    geometry.row_stride = mla_row_bytes(fmt.kv_format) + row_pad;
    geometry.block_stride = geometry.row_stride * block_size + block_pad;
    cache.assign(geometry.bytes(), 0xA5);
    attention_inputs::Rng rng{seed};
    std::vector<uint8_t> row(mla_row_bytes(fmt.kv_format));
    for (int64_t s = 0; s < geometry.num_slots(); ++s) {
      float kv_c[512], k_pe[64];
      attention_inputs::random_row(rng, kv_c, 512, 1.0, 3);
      attention_inputs::random_row(rng, k_pe, 64, 1.0, 4);
      attention_inputs::encode_mla_row(kv_c, k_pe, fmt, row.data());
      std::memcpy(cache.data() + geometry.row_offset(s), row.data(), row.size());
    }
    q.resize(num_tokens * num_heads * 576);
    for (int64_t r = 0; r < num_tokens * num_heads; ++r) {
      float x[576];
      attention_inputs::random_row(rng, x, 576, 0.5, 2);
      for (int d = 0; d < 576; ++d) q[r * 576 + d] = codec::float_to_bf16(x[d]);
    }
    indices.resize(num_tokens * topk);
    for (auto& v : indices)
      v = rng.uniform() < minus_one_rate ? -1 : static_cast<int32_t>(rng.next() % geometry.num_slots());
  }
  SparseMlaParams params() {
    out.assign(num_tokens * num_heads * 512, 1234.5f);
    lse.assign(num_tokens * num_heads, 1234.5f);
    SparseMlaParams p;
    p.num_tokens = num_tokens;
    p.num_heads = num_heads;
    p.q = q.data();
    p.mla_cache = cache.data();
    p.geometry = geometry;
    p.fmt = fmt;
    p.indices = indices.data();
    p.topk = topk;
    p.softmax_scale = softmax_scale;
    p.out = out.data();
    p.lse = lse.data();
    return p;
  }
};

/// c's fp8_ds_mla cache with every tile scale replaced in place by its bf16 rounding (round to nearest even):
/// what SparseMlaParams::scales_as_bf16 makes the attention read.
inline void round_tile_scales_to_bf16(AttentionCase& c) {
  for (int64_t s = 0; s < c.geometry.num_slots(); ++s) {
    uint8_t* sp = c.cache.data() + c.geometry.row_offset(s) + kDsMlaScaleOffset;
    for (int i = 0; i < 4; ++i) {
      float f;
      std::memcpy(&f, sp + 4 * i, 4);
      f = codec::bf16_to_float(codec::float_to_bf16(f));
      std::memcpy(sp + 4 * i, &f, 4);
    }
  }
}

inline CacheFormat format_of(KvFormat f, DsMlaScale s = DsMlaScale::kPow2) {
  CacheFormat c;
  c.kv_format = f;
  c.ds_mla_scale = s;
  c.k_scale = 1.0f / 24.0f;  // not a power of two: the dequant product rounds
  c.has_indexer = true;
  return c;
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace pcpkv::test
