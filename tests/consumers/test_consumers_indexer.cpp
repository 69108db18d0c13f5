// pcpkv-test-labels: unit
// The CPU indexer (pcpkv/consumers/indexer.h) against an independent fp64 statement of SPEC section 6 and the
// top-k contract: k = min(topk, len), score descending, ties to the lower position, -1 padded, causal.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/consumers.h"
#include "pcpkv/core/error.h"
#include "pcpkv/consumers/indexer.h"
#include "support/consumers_fixture.h"

namespace pcpkv {
namespace {

using test::IndexerCase;

constexpr double kU = 1.0 / 16777216.0;

IndexerCase mixed_case() {
  IndexerCase c;
  c.num_heads = 8;
  c.block_size = 16;
  c.topk = 32;
  c.request_len = {70, 9, 45};
  // prefill-like tokens of request 0 (some past topk), decode-like last tokens, a padding row
  c.token_request = {0, 0, 0, 0, 1, 2, -1, 2, 0};
  c.token_position = {0, 5, 31, 69, 8, 44, 0, 12, 40};
  c.build();
  return c;
}

TEST(ConsumersIndexer, QuantizerFollowsTheUe8m0Rule) {
  std::vector<uint16_t> q(2 * 3 * 128);
  detail_attn::Rng rng{3};
  for (auto& v : q) v = codec::float_to_bf16(static_cast<float>(rng.normal() * 3.0));
  q[5] = codec::float_to_bf16(700.0f);                         // an outlier beyond 448
  for (int d = 0; d < 128; ++d) q[128 + d] = 0;                // an all-zero head: smallest scale, zero bytes
  std::vector<uint8_t> b(q.size());
  std::vector<float> s(6);
  quantize_index_queries(q.data(), 2, 3, b.data(), s.data());
  for (int r = 0; r < 6; ++r) {
    float amax = 0.0f;
    for (int d = 0; d < 128; ++d) amax = std::max(amax, std::fabs(codec::bf16_to_float(q[r * 128 + d])));
    // s = 2^ceil(log2(max(amax, 1e-4) / 448)): a power of two with amax / 448 <= s < 2 * amax / 448.
    const double lo = std::max<double>(amax, 1e-4) / 448.0;
    EXPECT_EQ(s[r], std::exp2(std::ceil(std::log2(static_cast<double>(std::max(amax, 1e-4f) / 448.0f))))) << r;
    EXPECT_GE(s[r], lo * (1 - 1e-7)) << r;
    EXPECT_LT(s[r], 2 * lo) << r;
    for (int d = 0; d < 128; ++d) {
      const float x = codec::bf16_to_float(q[r * 128 + d]);
      ASSERT_EQ(b[r * 128 + d], codec::float_to_e4m3(x / s[r])) << r << " " << d;
      ASSERT_LE(std::fabs(codec::e4m3_to_float(b[r * 128 + d]) * s[r] - x), std::fabs(x) / 16 + s[r] / 1024);
    }
  }
  for (int d = 0; d < 128; ++d) EXPECT_EQ(b[128 + d], 0);
}

// The kExact logit is the exact dot product rounded once: against an int64 computation (every E4M3 value
// is a multiple of 2^-9), for random rows with the extremes (+-448, subnormals, zeros) mixed in; and it
// does not depend on the order of the dims.
TEST(ConsumersIndexer, ExactLogitIsTheRoundedExactSum) {
  detail_attn::Rng rng{21};
  std::vector<uint8_t> special = {0x7e, 0xfe, 0x01, 0x81, 0x00, 0x80, 0x07, 0x08, 0x77};  // 448, -448, 2^-9, ...
  int64_t inexact = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    uint8_t qb[128], kb[128];
    for (int d = 0; d < 128; ++d) {
      const auto pick = [&]() -> uint8_t {
        if (rng.uniform() < 0.1) return special[rng.next() % special.size()];
        uint8_t b = static_cast<uint8_t>(rng.next());
        if ((b & 0x7f) == 0x7f) b ^= 1;  // no NaN
        return b;
      };
      qb[d] = pick();
      kb[d] = pick();
    }
    float q[128], k[128], qr[128], kr[128];
    int64_t exact = 0;  // in units of 2^-18
    for (int d = 0; d < 128; ++d) {
      q[d] = codec::e4m3_to_float(qb[d]);
      k[d] = codec::e4m3_to_float(kb[d]);
      qr[127 - d] = q[d];
      kr[127 - d] = k[d];
      exact += static_cast<int64_t>(std::ldexp(double(q[d]), 9)) * static_cast<int64_t>(std::ldexp(double(k[d]), 9));
    }
    const float want = static_cast<float>(std::ldexp(static_cast<double>(exact), -18));
    const float got = consumers::index_logit_exact(q, k);
    ASSERT_EQ(test::bits_of(got), test::bits_of(want == 0.0f ? 0.0f : want)) << trial;
    ASSERT_EQ(test::bits_of(consumers::index_logit_exact(qr, kr)), test::bits_of(got)) << trial;
    inexact += static_cast<double>(got) != std::ldexp(static_cast<double>(exact), -18);
  }
  EXPECT_GT(inexact, 100);  // the rounding is exercised, not only exact small sums
  // an exact zero from signed terms is +0
  float q[128] = {}, k[128] = {};
  q[0] = -1.0f;
  k[0] = 0.0f;
  EXPECT_EQ(test::bits_of(consumers::index_logit_exact(q, k)), 0u);
  EXPECT_EQ(test::bits_of(consumers::index_logit_from_exact(-0.0)), 0u);
}

// A NaN score is stored as 0x7fffffff whatever NaN produced it (x86 would keep the input's payload).
TEST(ConsumersIndexer, NanScoresAreTheCanonicalNan) {
  IndexerCase c;
  c.num_heads = 4;
  c.topk = 5;
  c.request_len = {20};
  c.token_request = {0, 0};
  c.token_position = {0, 19};
  c.build();
  for (int h = 0; h < 4; ++h) c.weights[h] = std::numeric_limits<float>::quiet_NaN();
  c.weights[4 + 1] = -std::numeric_limits<float>::quiet_NaN();
  for (IndexerLogit logit : {IndexerLogit::kExact, IndexerLogit::kFp32Tree}) {
    IndexerParams p = c.params();
    p.logit = logit;
    indexer_reference(p);
    EXPECT_EQ(test::bits_of(c.scores[0]), 0x7fffffffu);
    for (int64_t j = 0; j < 20; ++j) EXPECT_EQ(test::bits_of(c.scores[c.max_keys + j]), 0x7fffffffu) << j;
    EXPECT_EQ(consumers::canonical_nan(1.5f), 1.5f);
  }
  EXPECT_STREQ(to_string(IndexerLogit::kExact), "exact");
  EXPECT_STREQ(to_string(IndexerLogit::kFp32Tree), "fp32_tree");
}

// Both logit rules give the same top-k on this case (they differ in the last bit of some logits only).
TEST(ConsumersIndexer, LogitRulesAgreeToTheLastBits) {
  IndexerCase c = mixed_case();
  IndexerParams p = c.params();
  indexer_reference(p);
  const auto exact = c.scores;
  p = c.params();
  p.logit = IndexerLogit::kFp32Tree;
  indexer_reference(p);
  int64_t differ = 0, checked = 0;
  for (size_t t = 0; t < c.token_request.size(); ++t) {
    if (c.token_request[t] < 0) continue;
    for (int64_t j = 0; j <= c.token_position[t]; ++j) {
      const float a = exact[t * c.max_keys + j], b = c.scores[t * c.max_keys + j];
      differ += test::bits_of(a) != test::bits_of(b);
      ASSERT_LE(std::fabs(double(a) - b), 1e-5 * (std::fabs(double(a)) + 1e-3)) << t << " " << j;
      ++checked;
    }
  }
  EXPECT_GT(checked, 200);
  std::printf("kExact vs kFp32Tree: %lld of %lld scores differ in their bits\n", (long long)differ, (long long)checked);
}

// Scores against fp64: the fp32 order (exact products, 128-term sums, H-term head sum) errs by at most
// (128 + H + 4) u relative to the sum of absolute terms (kExact: one rounding per logit, tighter).
TEST(ConsumersIndexer, ScoresMatchFp64WithinTheSummationBound) {
  for (IndexerLogit logit : {IndexerLogit::kExact, IndexerLogit::kFp32Tree}) {
  IndexerCase c = mixed_case();
  IndexerParams p = c.params();
  p.logit = logit;
  indexer_reference(p);
  const int H = c.num_heads;
  const double cw = 1.0 / std::sqrt(128.0 * H);
  int64_t checked = 0;
  for (size_t t = 0; t < c.token_request.size(); ++t) {
    if (c.token_request[t] < 0) continue;
    for (int64_t j = 0; j <= c.token_position[t]; ++j) {
      const int64_t s = c.slot(c.token_request[t], j);
      const uint8_t* kb = c.cache.data() + c.geometry.data_offset(s);
      float ks;
      std::memcpy(&ks, c.cache.data() + c.geometry.scale_offset(s), 4);
      double exact = 0.0, mag = 0.0;
      for (int h = 0; h < H; ++h) {
        double logit = 0.0, labs = 0.0;
        for (int d = 0; d < 128; ++d) {
          const double pr = double(codec::e4m3_to_float(c.q_fp8[(t * H + h) * 128 + d])) * codec::e4m3_to_float(kb[d]);
          logit += pr;
          labs += std::fabs(pr);
        }
        const double w = double(c.weights[t * H + h]) * cw * c.q_scale[t * H + h];
        exact += std::max(logit, 0.0) * w;
        mag += labs * std::fabs(w);
      }
      exact *= ks;
      mag *= ks;
      const double got = c.scores[t * c.max_keys + j];
      ASSERT_LE(std::fabs(got - exact), (128.0 + H + 4.0) * kU * mag + 1e-38) << "token " << t << " key " << j;
      ++checked;
    }
  }
  EXPECT_GT(checked, 200);
  }
}

// The top-k contract, checked against the returned scores with an independent stable sort.
TEST(ConsumersIndexer, TopkIsTheSortedCausalSelection) {
  IndexerCase c = mixed_case();
  IndexerParams p = c.params();
  indexer_reference(p);
  for (size_t t = 0; t < c.token_request.size(); ++t) {
    const int32_t* slots = &c.topk_slots[t * c.topk];
    const int32_t* pos = &c.topk_pos[t * c.topk];
    if (c.token_request[t] < 0) {
      for (int i = 0; i < c.topk; ++i) ASSERT_TRUE(slots[i] == -1 && pos[i] == -1) << "padding row " << t;
      continue;
    }
    const int64_t len = c.token_position[t] + 1;
    std::vector<int64_t> order(len);
    std::iota(order.begin(), order.end(), 0);
    const float* sc = &c.scores[t * c.max_keys];
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sc[a] > sc[b]; });
    const int64_t k = std::min<int64_t>(c.topk, len);
    for (int64_t i = 0; i < c.topk; ++i) {
      if (i < k) {
        ASSERT_EQ(pos[i], order[i]) << "token " << t << " rank " << i;
        ASSERT_EQ(slots[i], c.slot(c.token_request[t], order[i])) << "token " << t << " rank " << i;
      } else {
        ASSERT_EQ(pos[i], -1);
        ASSERT_EQ(slots[i], -1);
      }
    }
    // causal: the token itself is a key; nothing beyond its position
    ASSERT_TRUE(std::all_of(pos, pos + k, [&](int32_t v) { return v >= 0 && v < len; }));
  }
}

TEST(ConsumersIndexer, TiesGoToTheLowerPosition) {
  IndexerCase c;
  c.num_heads = 4;
  c.topk = 6;
  c.request_len = {40};
  c.token_request = {0};
  c.token_position = {39};
  c.build();
  // Make key 3 the best (largest score) and copy it to 10 later positions: 11 equal scores for 6 places.
  IndexerParams p = c.params();
  indexer_reference(p);
  const int32_t best = c.topk_pos[0];
  for (int64_t j : {36, 30, 25, 20, 17, 14, 12, 11, 9, 2}) c.copy_key(0, best, j);
  p = c.params();
  indexer_reference(p);
  std::set<int32_t> tied_set = {best, 2, 9, 11, 12, 14, 17, 20, 25, 30, 36};
  const std::vector<int32_t> tied(tied_set.begin(), tied_set.end());  // ascending
  ASSERT_GE(tied.size(), 10u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(c.topk_pos[i], tied[i]) << i;
}

TEST(ConsumersIndexer, NanScoresRankLastAndZeroScoresTie) {
  IndexerCase c;
  c.num_heads = 4;
  c.topk = 5;
  c.request_len = {20};
  c.token_request = {0, 0};
  c.token_position = {19, 19};
  c.build();
  for (int h = 0; h < 4; ++h) c.weights[0 * 4 + h] = std::numeric_limits<float>::quiet_NaN();  // every score NaN
  for (int h = 0; h < 4; ++h) c.weights[1 * 4 + h] = (h % 2) ? 0.0f : -0.0f;                 // every score 0
  IndexerParams p = c.params();
  indexer_reference(p);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(c.topk_pos[i], i) << "NaN row";
    EXPECT_EQ(c.topk_pos[5 + i], i) << "zero row";
  }
}

TEST(ConsumersIndexer, BadInputThrowsBeforeWriting) {
  IndexerCase c = mixed_case();
  auto expect_throw = [&](auto mutate, const std::string& needle) {
    IndexerCase d = c;
    IndexerParams p = d.params();
    mutate(d, p);
    try {
      indexer_reference(p);
      ADD_FAILURE() << "no throw for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(std::all_of(d.topk_slots.begin(), d.topk_slots.end(), [](int32_t v) { return v == 0x5a5a5a5a; }))
        << needle << ": output written before the throw";
  };
  expect_throw([](IndexerCase& d, IndexerParams&) { d.token_request[2] = 3; }, "request_idx[2] = 3");
  expect_throw([](IndexerCase& d, IndexerParams&) { d.token_position[4] = 100; },
               "positions[4] = 100 is out of range [0, max_keys = 70)");
  expect_throw([](IndexerCase&, IndexerParams& p) { p.block_table_stride = 2; p.num_requests = 1; },
               "needs 5 blocks but block_table_stride is 2");
  expect_throw([](IndexerCase& d, IndexerParams&) { d.tables[1] = 999; }, "block_tables[0, 1] = 999");
  expect_throw([](IndexerCase&, IndexerParams& p) { p.num_heads = 0; }, "num_heads");
  expect_throw([](IndexerCase&, IndexerParams& p) { p.topk = 0; }, "topk");
  expect_throw([](IndexerCase&, IndexerParams& p) { p.max_keys = 10; }, "max_keys");
}

TEST(ConsumersIndexer, OrderKeyIsMonotoneWithNanLowest) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> v = {-inf, -1e30f, -1.0f, -1e-40f, 0.0f, 1e-40f, 1.0f, 1e30f, inf};
  for (size_t i = 1; i < v.size(); ++i) EXPECT_LT(consumers::order_key(v[i - 1]), consumers::order_key(v[i])) << i;
  EXPECT_EQ(consumers::order_key(-0.0f), consumers::order_key(0.0f));
  EXPECT_EQ(consumers::order_key(std::numeric_limits<float>::quiet_NaN()), 0u);
  EXPECT_EQ(consumers::order_key(-std::numeric_limits<float>::quiet_NaN()), 0u);
  EXPECT_LT(0u, consumers::order_key(-inf));
  // equal scores: the lower position has the larger key
  EXPECT_GT(consumers::sort_key(2.0f, 5), consumers::sort_key(2.0f, 6));
  EXPECT_EQ(consumers::sort_key_position(consumers::sort_key(-3.0f, 123456789)), 123456789);
}

TEST(ConsumersIndexer, WeightScaleIsFoldedAsDocumented) {
  EXPECT_EQ(index_weight_scale(64), static_cast<float>(1.0 / std::sqrt(128.0 * 64)));
  EXPECT_EQ(index_weight_scale(32), 0.015625f);
  EXPECT_THROW(index_weight_scale(0), Error);
}

}  // namespace
}  // namespace pcpkv
