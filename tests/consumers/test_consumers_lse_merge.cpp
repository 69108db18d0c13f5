// pcpkv-test-labels: unit
// The CPU LSE merge (pcpkv/consumers/lse_merge.h): partial attention over split key sets merges back to the
// whole; NaN / +inf / -inf shards contribute nothing; one shard is the identity.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/core/error.h"
#include "pcpkv/consumers/lse_merge.h"
#include "pcpkv/consumers/sparse_mla.h"
#include "support/consumers_fixture.h"

namespace pcpkv {
namespace {

using test::AttentionCase;
using test::bits_of;
using test::format_of;

constexpr double kU = 1.0 / 16777216.0;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// Split every token's index row over S shards (entry i goes to shard i % S, others -1), attend per
// shard, merge: equals attention over the whole row within the rounding of the fp32 partials.
TEST(ConsumersLseMerge, SplitKeysMergeBackToTheWhole) {
  AttentionCase c;
  c.fmt = format_of(KvFormat::kFp8DsMla);
  c.num_heads = 3;
  c.num_tokens = 5;
  c.topk = 24;
  c.minus_one_rate = 0.1;
  c.build();
  std::fill(c.indices.begin() + 4 * c.topk, c.indices.begin() + 5 * c.topk, -1);  // token 4: one key only
  c.indices[4 * c.topk + 3] = 5;
  std::fill(c.indices.begin() + 2 * c.topk, c.indices.begin() + 3 * c.topk, -1);  // token 2: none
  SparseMlaParams p = c.params();
  SparseMlaRefStats stats;
  sparse_mla_reference(p, &stats);
  const std::vector<float> whole = c.out, whole_lse = c.lse;
  for (int S : {1, 2, 3, 5}) {
    const int64_t R = c.num_tokens * c.num_heads;
    std::vector<float> outs(S * R * 512), lses(S * R);
    for (int n = 0; n < S; ++n) {
      AttentionCase d = c;
      for (int64_t t = 0; t < d.num_tokens; ++t)
        for (int i = 0; i < d.topk; ++i)
          if (i % S != n) d.indices[t * d.topk + i] = -1;
      SparseMlaParams q = d.params();
      sparse_mla_reference(q);
      std::copy(d.out.begin(), d.out.end(), outs.begin() + n * R * 512);
      std::copy(d.lse.begin(), d.lse.end(), lses.begin() + n * R);
    }
    std::vector<float> out(R * 512, 7.0f), lse(R, 7.0f);
    LseMergeParams m{S, R, 512, outs.data(), lses.data(), out.data(), lse.data()};
    lse_merge_reference(m);
    for (int64_t r = 0; r < R; ++r) {
      if (std::isinf(whole_lse[r])) {  // no key anywhere: -inf and zeros
        ASSERT_EQ(lse[r], -kInf) << "S " << S << " row " << r;
        for (int d = 0; d < 512; ++d) ASSERT_EQ(bits_of(out[r * 512 + d]), 0u);
        continue;
      }
      // partials rounded to fp32: weights move by ~u (1 + |lse|), values by u
      const double rel = (4.0 + 4.0 * std::fabs(whole_lse[r])) * kU;
      ASSERT_LE(std::fabs(lse[r] - whole_lse[r]), rel + 2 * kU * std::fabs(whole_lse[r])) << "S " << S << " row " << r;
      for (int d = 0; d < 512; ++d)
        ASSERT_LE(std::fabs(out[r * 512 + d] - whole[r * 512 + d]),
                  rel * stats.abs_pv[r * 512 + d] + 2 * kU * std::fabs(whole[r * 512 + d]) + 1e-30)
            << "S " << S << " row " << r << " dim " << d;
    }
    if (S == 1) {
      for (int64_t i = 0; i < R * 512; ++i) ASSERT_EQ(bits_of(out[i]), bits_of(whole[i])) << "one shard: identity";
    }
  }
}

TEST(ConsumersLseMerge, NanAndInfiniteShardsContributeNothing) {
  const int S = 4, R = 3, D = 8;
  std::vector<float> outs(S * R * D), lses(S * R);
  for (size_t i = 0; i < outs.size(); ++i) outs[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
  // row 0: shard 0 valid, shard 1 NaN lse (NaN outputs), shard 2 +inf, shard 3 -inf
  // row 1: every shard empty or broken
  // row 2: two valid shards and a -inf one with NaN outputs
  lses = {1.5f, -kInf, 0.25f, kNan, -kInf, kNan, kInf, kNan, -3.0f, -kInf, -kInf, -kInf};
  for (int d = 0; d < D; ++d) {
    outs[(1 * R + 0) * D + d] = kNan;
    outs[(3 * R + 2) * D + d] = kNan;
  }
  std::vector<float> out(R * D, 9.0f), lse(R, 9.0f);
  LseMergeParams m{S, R, D, outs.data(), lses.data(), out.data(), lse.data()};
  lse_merge_reference(m);
  // row 0 is shard 0 alone: exactly its output and lse
  EXPECT_EQ(lse[0], 1.5f);
  for (int d = 0; d < D; ++d) EXPECT_EQ(out[d], outs[(0 * R + 0) * D + d]) << d;
  // row 1: nothing valid
  EXPECT_EQ(lse[1], -kInf);
  for (int d = 0; d < D; ++d) EXPECT_EQ(bits_of(out[D + d]), 0u);
  // row 2: shards 0 (0.25) and 2 (-3.0)
  const double L = std::log(std::exp(0.25) + std::exp(-3.0));
  EXPECT_NEAR(lse[2], L, 1e-6);
  for (int d = 0; d < D; ++d) {
    const double want = std::exp(0.25 - L) * outs[(0 * R + 2) * D + d] + std::exp(-3.0 - L) * outs[(2 * R + 2) * D + d];
    EXPECT_NEAR(out[2 * D + d], want, 1e-6) << d;
    EXPECT_FALSE(std::isnan(out[2 * D + d]));
  }
}

TEST(ConsumersLseMerge, BadInputThrows) {
  std::vector<float> a(16), b(2);
  LseMergeParams m{0, 2, 8, a.data(), b.data(), a.data(), b.data()};
  EXPECT_THROW(lse_merge_reference(m), Error);
  m.num_shards = 1;
  m.head_dim = 0;
  EXPECT_THROW(lse_merge_reference(m), Error);
  m.head_dim = 8;
  m.lses = nullptr;
  EXPECT_THROW(lse_merge_reference(m), Error);
}

TEST(ConsumersLseMerge, BoundIsFiniteAndScalesWithShards) {
  std::vector<float> outs = {1.0f, -2.0f, 0.5f, 0.5f}, lses = {2.0f, 1.0f};
  LseMergeParams m{2, 1, 2, outs.data(), lses.data(), nullptr, nullptr};
  const double b = LseMergeBound::out_bound(m, 0, 0, 0.8);
  EXPECT_GT(b, 0.0);
  EXPECT_LT(b, 1e-5);
  EXPECT_GT(LseMergeBound::lse_bound(m, 0, 2.3), 0.0);
}

}  // namespace
}  // namespace pcpkv
