// pcpkv-test-labels: unit
// Generated inputs (pcpkv/core/inputs.h): seeded, LLM-like, independent of threads, validated; per-rank views.
#include <algorithm>
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "support/error_of.h"

namespace pcpkv {
namespace {

PcpPlan plan_of(int32_t pcp, std::vector<RequestSpec> requests, int32_t block_size = 16) {
  PlanConfig pc;
  pc.pcp_world = pcp;
  pc.block_size = block_size;
  pc.requests = std::move(requests);
  return make_plan(pc);
}

using test::error_of;

TEST(Inputs, SeededShapesAndIndependentOfRankCount) {
  const ModelConfig m = preset("glm-5");
  const PcpPlan p4 = plan_of(4, {{RequestKind::kPrefill, 300, 0}, {RequestKind::kDecode, 1, 50}});
  const PcpPlan p1 = plan_of(1, {{RequestKind::kPrefill, 300, 0}, {RequestKind::kDecode, 1, 50}});
  const GlobalInputs a = generate_inputs(m, p4, true, 7);
  const GlobalInputs b = generate_inputs(m, p1, true, 7);
  const GlobalInputs c = generate_inputs(m, p4, true, 8);
  EXPECT_EQ(a.num_tokens, 301);
  EXPECT_EQ(a.q_c.size(), 301u * 2048);
  EXPECT_EQ(a.kv.size(), 301u * 512);
  EXPECT_EQ(a.k_pe.size(), 301u * 64);
  EXPECT_EQ(a.index_k.size(), 301u * 128);
  EXPECT_EQ(a.positions, p4.global_positions);
  EXPECT_EQ(a.q_c, b.q_c);
  EXPECT_EQ(a.kv, b.kv);
  EXPECT_EQ(a.index_k, b.index_k);
  EXPECT_EQ(a.weights.kv_norm_w, b.weights.kv_norm_w);
  EXPECT_NE(a.kv, c.kv) << "another seed, other values";
  EXPECT_NO_THROW(validate_inputs(a, m, p4, true));
  const GlobalInputs no_index = generate_inputs(m, p4, false, 7);
  EXPECT_TRUE(no_index.index_k.empty());
  EXPECT_TRUE(no_index.weights.index_ln_w.empty());
  EXPECT_EQ(no_index.kv, a.kv) << "the indexer flag does not change the other tensors";
}

TEST(Inputs, LlmLikeStatistics) {
  const ModelConfig m = preset("deepseek-v3.2");
  const PcpPlan p = plan_of(2, {{RequestKind::kPrefill, 512, 0}});
  const GlobalInputs in = generate_inputs(m, p, true, 3);
  auto stats = [](const std::vector<uint16_t>& v, int64_t width, const char* name) {
    const int64_t rows = static_cast<int64_t>(v.size()) / width;
    std::vector<double> chan(static_cast<size_t>(width), 0.0), row_rms(static_cast<size_t>(rows), 0.0);
    int64_t zeros = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; ++c) {
        const double x = codec::bf16_to_float(v[static_cast<size_t>(r * width + c)]);
        ASSERT_TRUE(std::isfinite(x)) << name;
        zeros += x == 0.0;
        chan[static_cast<size_t>(c)] = std::max(chan[static_cast<size_t>(c)], std::fabs(x));
        row_rms[static_cast<size_t>(r)] += x * x;
      }
    EXPECT_EQ(zeros, 0) << name << ": never zeros";
    std::vector<double> sorted = chan;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[sorted.size() / 2];
    const auto outliers = std::count_if(chan.begin(), chan.end(), [&](double a) { return a > 8 * median; });
    EXPECT_GE(outliers, 2) << name << ": 2-4 outlier channels";
    EXPECT_LE(outliers, 4) << name;
    std::sort(row_rms.begin(), row_rms.end());
    EXPECT_GT(row_rms.back() / row_rms.front(), 4.0) << name << ": token magnitudes vary (log-normal)";
  };
  stats(in.q_c, 1536, "q_c");
  stats(in.kv, 512, "kv");
  stats(in.k_pe, 64, "k_pe");
  stats(in.index_k, 128, "index_k");
  for (float w : in.weights.kv_norm_w) {
    ASSERT_GT(w, 0.0f);
    ASSERT_EQ(w, codec::bf16_to_float(codec::float_to_bf16(w))) << "weights are bf16 values";
  }
}

TEST(Inputs, CountNonFinite) {
  const ModelConfig m = preset("glm-5");
  const PcpPlan p = plan_of(1, {{RequestKind::kPrefill, 8, 0}});
  GlobalInputs in = generate_inputs(m, p, true, 1);
  EXPECT_EQ(count_nonfinite(in).total(), 0);
  EXPECT_EQ(count_nonfinite(in).describe(), "all values finite");
  in.kv[3] = 0x7fc0;   // NaN
  in.kv[9] = 0xff80;   // -inf
  in.index_k[0] = 0x7f80;
  in.weights.q_norm_w[2] = INFINITY;
  const NonFiniteReport r = count_nonfinite(in);
  EXPECT_EQ(r.kv, 2);
  EXPECT_EQ(r.index_k, 1);
  EXPECT_EQ(r.weights, 1);
  EXPECT_EQ(r.total(), 4);
  EXPECT_EQ(r.describe(), "kv: 2 non-finite values, index_k: 1 non-finite value, weights: 1 non-finite value");
}

TEST(Inputs, ValidateNamesTheTensor) {
  const ModelConfig m = preset("glm-5");
  const PcpPlan p = plan_of(2, {{RequestKind::kPrefill, 20, 0}});
  const GlobalInputs good = generate_inputs(m, p, true, 1);
  auto bad = [&](auto mutate) {
    GlobalInputs in = good;
    mutate(in);
    return error_of([&] { validate_inputs(in, m, p, true); });
  };
  EXPECT_NE(bad([](GlobalInputs& in) { in.kv.pop_back(); }).find("kv has 10239 values, expected [20, 512]"),
            std::string::npos);
  EXPECT_NE(bad([](GlobalInputs& in) { in.index_k.clear(); }).find("index_k has 0 values"), std::string::npos);
  EXPECT_NE(bad([](GlobalInputs& in) { in.num_tokens = 19; }).find("num_tokens = 19"), std::string::npos);
  EXPECT_NE(bad([](GlobalInputs& in) { in.q_lora_rank = 1536; }).find("q_lora_rank = 1536"), std::string::npos);
  EXPECT_NE(bad([](GlobalInputs& in) { in.positions[4] = 40; }).find("positions[4] = 40"), std::string::npos);
  EXPECT_NE(bad([](GlobalInputs& in) { in.weights.index_ln_b.resize(64); }).find("index_ln_b"), std::string::npos);
  GlobalInputs no_index = generate_inputs(m, p, false, 1);
  EXPECT_NO_THROW(validate_inputs(no_index, m, p, false));
}

TEST(Inputs, RankInputsGatherRowsAndFillPaddingWithJunk) {
  const ModelConfig m = preset("glm-5");
  // 13 tokens per rank on some ranks, fewer on others: padding rows exist.
  const PcpPlan p = plan_of(4, {{RequestKind::kPrefill, 101, 0}, {RequestKind::kDecode, 1, 7}});
  const GlobalInputs in = generate_inputs(m, p, true, 5);
  for (int32_t r = 0; r < 4; ++r) {
    const RankInputs ri = rank_inputs(in, p, r);
    const RankPlan& rp = p.ranks[static_cast<size_t>(r)];
    ASSERT_EQ(ri.num_tokens, p.max_local_tokens);
    EXPECT_EQ(ri.slot_mapping, rp.slot_mapping);
    EXPECT_EQ(ri.positions, rp.positions);
    for (int64_t i = 0; i < p.max_local_tokens; ++i) {
      const int64_t g = rp.global_index[static_cast<size_t>(i)];
      if (g >= 0) {
        ASSERT_TRUE(std::equal(ri.kv.begin() + i * 512, ri.kv.begin() + (i + 1) * 512, in.kv.begin() + g * 512));
        ASSERT_TRUE(std::equal(ri.q_c.begin() + i * 2048, ri.q_c.begin() + (i + 1) * 2048, in.q_c.begin() + g * 2048));
      } else {
        for (int64_t c = 0; c < 512; ++c) ASSERT_NE(ri.kv[static_cast<size_t>(i * 512 + c)] & 0x7fff, 0) << "junk, not zeros";
      }
    }
    RankInputs reused;
    rank_inputs(in, p, r, &reused);
    EXPECT_EQ(reused.kv, ri.kv) << "padding junk is seeded";
  }
  EXPECT_NE(error_of([&] { rank_inputs(in, p, 4); }).find("rank = 4 is out of range"), std::string::npos);
}

}  // namespace
}  // namespace pcpkv
