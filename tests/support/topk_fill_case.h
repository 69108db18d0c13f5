// tests/support/topk_fill_case.h: one step's top-k buffer shared by the dispatch's fill
// (pcpkv/publish/dispatch.h TopkFill) and pcpkv's indexer top-k (pcpkv/consumers/indexer.h), for the CPU
// unit test and the CUDA test.
//
// The step: n = 17 rows the indexer runs on (its num_tokens), then 5 padding rows past the step's tokens that
// no indexer visits (T = 22 dispatch rows). topk = topk_width = 32. The indexer's rows cover a prefill chunk of
// a request shorter than topk (10 keys), a chunk of one longer than topk (80 keys), a decode longer (position
// 50) and one shorter (position 5) than topk, and a row with request -1 (the indexer writes it -1 itself).
#pragma once

#include <cstdint>
#include <vector>

#include "pcpkv/device/codec.h"
#include "pcpkv/publish/dispatch.h"
#include "pcpkv/consumers/indexer.h"
#include "pcpkv/core/rope.h"
#include "support/random_bf16.h"
#include "support/consumers_fixture.h"

namespace pcpkv::test {

struct TopkFillCase {
  static constexpr int64_t kIndexerRows = 17;  // n
  static constexpr int64_t kRows = 22;         // T = n + 5 padding rows
  static constexpr int32_t kTopk = 32;
  static constexpr uint32_t kPoison = 0x5A3C5A3Cu;  // neither -1 nor 0 nor a slot

  IndexerCase idx;
  std::vector<uint16_t> kv, k_pe, index_k;
  std::vector<int64_t> positions;  // [T] (padding rows: 0)
  std::vector<float> kv_w, ln_w, ln_b;
  RopeTable rope;

  TopkFillCase() : rope(make_rope_table(RopeConfig{}, 128)) {
    idx.topk = kTopk;
    idx.request_len = {10, 80, 51, 6};
    for (int64_t p = 4; p < 10; ++p) add(0, p);   // prefill chunk, request shorter than topk
    for (int64_t p = 60; p < 68; ++p) add(1, p);  // prefill chunk, request longer than topk
    add(2, 50);                                    // decode, longer than topk
    add(3, 5);                                     // decode, shorter than topk
    add(-1, 0);                                    // a request -1 row the indexer still runs on
    idx.build();
    positions = idx.token_position;
    positions.resize(kRows, 0);
    kv = random_bf16(kRows, 512, 71);
    k_pe = random_bf16(kRows, 64, 72, 2, 2.0);
    index_k = random_bf16(kRows, 128, 73);
    kv_w = random_weights(512, 74, 1.0, 0.3);
    ln_w = random_weights(128, 75, 1.0, 0.2);
    ln_b = random_weights(128, 76, 0.0, 0.05);
  }

  void add(int32_t req, int64_t pos) {
    idx.token_request.push_back(req);
    idx.token_position.push_back(pos);
  }

  static std::vector<int32_t> poisoned() {
    return std::vector<int32_t>(static_cast<size_t>(kRows * kTopk), static_cast<int32_t>(kPoison));
  }

  /// Dispatch of the T rows with a materialized indexer K (so the kernels run their per-token math next to the
  /// fill) into `topk` [T, kTopk]; pointers are the given ones (host for the CPU, device for CUDA).
  DispatchParams dispatch(TopkFill mode, int64_t indexer_rows, int32_t* topk, const uint16_t* d_kv,
                          const uint16_t* d_k_pe, const uint16_t* d_index_k, const int64_t* d_positions,
                          const float* d_kv_w, const float* d_ln_w, const float* d_ln_b, const float* d_rope,
                          uint16_t* d_index_k_out) const {
    DispatchParams p;
    p.num_tokens = kRows;
    p.q_lora_rank = 0;
    p.kv = d_kv;
    p.k_pe = d_k_pe;
    p.index_k = d_index_k;
    p.positions = d_positions;
    p.kv_norm_w = d_kv_w;
    p.index_ln_w = d_ln_w;
    p.index_ln_b = d_ln_b;
    p.rope_cos_sin = d_rope;
    p.rope_num_positions = rope.num_positions;
    p.fmt.kv_format = KvFormat::kFp8DsMla;
    p.fmt.has_indexer = true;
    p.index_k_out = d_index_k_out;
    p.topk_fill = topk;
    p.topk_width = kTopk;
    p.topk_fill_mode = mode;
    p.topk_indexer_rows = indexer_rows;
    return p;
  }

  /// The indexer top-k over the first n rows of `topk` (its own num_tokens), host pointers of the case.
  IndexerParams indexer(int32_t* topk) {
    IndexerParams p = idx.params();
    p.topk_slots = topk;
    p.topk_positions = nullptr;
    p.scores = nullptr;
    return p;
  }
};

}  // namespace pcpkv::test
