// pcpkv-test-labels: unit
// The MoE router's CPU reference (pcpkv/serving/router.h, SPEC section 7): presets, validation, the fp64 logits,
// grouped top-k on hand-built cases whose answer is worked out in the comments, the near-tie gaps, the
// dispatch table, and FP8 per-token-group quantization against independent bounds.
#include <climits>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"
#include "pcpkv/serving/router.h"
#include "support/error_of.h"
#include "support/random_bf16.h"

namespace pcpkv {
namespace {

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

using test::error_of;

RouterConfig small_config(int64_t experts, int64_t n_group, int64_t topk_group, int64_t top_k) {
  RouterConfig c;
  c.hidden_size = 64;
  c.n_experts = experts;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.top_k = top_k;
  c.routed_scaling_factor = 2.5;
  return c;
}

TEST(Router, PresetsComeFromModelConfig) {
  const RouterConfig glm = router_config(preset("glm-5"));
  EXPECT_EQ(glm.hidden_size, 6144);
  EXPECT_EQ(glm.n_experts, 256);
  EXPECT_EQ(glm.top_k, 8);
  EXPECT_EQ(glm.n_group, 1);
  EXPECT_EQ(glm.topk_group, 1);
  EXPECT_DOUBLE_EQ(glm.routed_scaling_factor, 2.5);
  EXPECT_TRUE(glm.norm_topk_prob);
  EXPECT_FALSE(glm.logits_bf16);  // GLM-5: fp32 logits

  const RouterConfig ds = router_config(preset("deepseek-v3.2"));
  EXPECT_EQ(ds.hidden_size, 7168);
  EXPECT_EQ(ds.n_experts, 256);
  EXPECT_EQ(ds.top_k, 8);
  EXPECT_EQ(ds.n_group, 8);
  EXPECT_EQ(ds.topk_group, 4);
  EXPECT_DOUBLE_EQ(ds.routed_scaling_factor, 2.5);
  EXPECT_TRUE(ds.logits_bf16);
}

TEST(Router, ValidationNamesFieldAndValue) {
  RouterConfig c = small_config(16, 4, 2, 4);
  validate_router_config(c);
  auto bad = c;
  bad.hidden_size = 60;
  EXPECT_NE(error_of([&] { validate_router_config(bad); }).find("hidden_size = 60"), std::string::npos);
  bad = c;
  bad.n_group = 3;
  EXPECT_NE(error_of([&] { validate_router_config(bad); }).find("n_group = 3"), std::string::npos);
  bad = c;
  bad.topk_group = 5;
  EXPECT_NE(error_of([&] { validate_router_config(bad); }).find("topk_group = 5"), std::string::npos);
  bad = c;
  bad.topk_group = 1;  // one kept group of 4 experts cannot hold top-5
  bad.top_k = 5;
  EXPECT_NE(error_of([&] { validate_router_config(bad); }).find("num_experts_per_tok = 5"), std::string::npos);
  bad = c;
  bad.n_experts = 1024;
  EXPECT_NE(error_of([&] { validate_router_config(bad); }).find("n_routed_experts = 1024"), std::string::npos);
  bad = c;
  bad.routed_scaling_factor = 0.0;
  EXPECT_NE(error_of([&] { validate_router_config(bad); }).find("routed_scaling_factor = 0"), std::string::npos);
  bad = small_config(16, 16, 4, 4);  // groups of one expert: no top-2 group score
  EXPECT_NE(error_of([&] { validate_router_config(bad); }).find("n_group = 16"), std::string::npos);
}

TEST(Router, LogitsReferenceIsExact) {
  // Small integers in bf16: every sum is exact, so the oracle is integer arithmetic.
  const int64_t T = 3, H = 16, E = 5;
  std::vector<uint16_t> x(T * 24);  // row stride 24 > H
  std::vector<uint16_t> wb(E * H);
  std::vector<float> wf(E * H);
  std::vector<int64_t> xi(T * H), wi(E * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < H; ++k) {
      xi[t * H + k] = (t * 7 + k * 3) % 11 - 5;
      x[t * 24 + k] = codec::float_to_bf16(static_cast<float>(xi[t * H + k]));
    }
  for (int64_t e = 0; e < E; ++e)
    for (int64_t k = 0; k < H; ++k) {
      wi[e * H + k] = (e * 5 + k * 2) % 9 - 4;
      wb[e * H + k] = codec::float_to_bf16(static_cast<float>(wi[e * H + k]));
      wf[e * H + k] = static_cast<float>(wi[e * H + k]);
    }
  std::vector<double> lb(T * E), lf(T * E), ab(T * E);
  router_logits_reference(x.data(), 24, wb.data(), RouterWeightDtype::kBf16, T, H, E, lb.data(), ab.data());
  router_logits_reference(x.data(), 24, wf.data(), RouterWeightDtype::kFp32, T, H, E, lf.data(), nullptr);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      int64_t s = 0, a = 0;
      for (int64_t k = 0; k < H; ++k) {
        s += xi[t * H + k] * wi[e * H + k];
        a += std::llabs(xi[t * H + k] * wi[e * H + k]);
      }
      EXPECT_EQ(lb[t * E + e], static_cast<double>(s)) << t << "," << e;
      EXPECT_EQ(lf[t * E + e], static_cast<double>(s));
      EXPECT_EQ(ab[t * E + e], static_cast<double>(a));
    }
  EXPECT_NE(error_of([&] {
              router_logits_reference(x.data(), 8, wb.data(), RouterWeightDtype::kBf16, T, H, E, lb.data(), nullptr);
            }).find("x_stride = 8"),
            std::string::npos);
}

TEST(Router, GroupedTopkHandCase) {
  // 16 experts in 4 groups of 4, keep 2 groups, top 4, no bias (biased score = sigmoid, monotone in logit).
  //   group 0: 3.0 -1 -2 2.0   score s(3.0) + s(2.0) = 1.8334
  //   group 1: 0.5 0.4 -3 -3   score s(0.5) + s(0.4) = 1.2212
  //   group 2: 2.5 2.4 2.3 -5  score s(2.5) + s(2.4) = 1.8410
  //   group 3: 4.0 -4 -4 -4    score s(4.0) + s(-4)  = 1.0000
  // Kept: groups 2 and 0. Expert 12 (the largest logit) is dropped with its group. Top 4 of experts
  // {0..3, 8..11}: 0 (3.0), 8 (2.5), 9 (2.4), 10 (2.3); expert 3 (2.0) just misses.
  const RouterConfig c = small_config(16, 4, 2, 4);
  const std::vector<double> logits = {3.0, -1, -2, 2.0, 0.5, 0.4, -3, -3, 2.5, 2.4, 2.3, -5, 4.0, -4, -4, -4};
  std::vector<int32_t> ids(4);
  std::vector<double> w(4);
  grouped_topk_reference(logits.data(), 1, nullptr, c, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 8, 9, 10}));
  const double sum = sigmoid(3.0) + sigmoid(2.5) + sigmoid(2.4) + sigmoid(2.3);
  EXPECT_NEAR(w[0], sigmoid(3.0) / sum * 2.5, 1e-15);
  EXPECT_NEAR(w[3], sigmoid(2.3) / sum * 2.5, 1e-15);
  EXPECT_NEAR(w[0] + w[1] + w[2] + w[3], 2.5, 1e-14);

  const auto gaps = routing_decision_gaps(logits.data(), 1, nullptr, c);
  ASSERT_EQ(gaps.size(), 1u);
  EXPECT_NEAR(gaps[0].group_gap, sigmoid(3.0) + sigmoid(2.0) - sigmoid(0.5) - sigmoid(0.4), 1e-15);
  EXPECT_NEAR(gaps[0].expert_gap, sigmoid(2.3) - sigmoid(2.0), 1e-15);

  // norm_topk_prob off: weights are the sigmoid scores times the scaling factor.
  RouterConfig raw = c;
  raw.norm_topk_prob = false;
  grouped_topk_reference(logits.data(), 1, nullptr, raw, ids.data(), w.data());
  EXPECT_NEAR(w[1], sigmoid(2.5) * 2.5, 1e-15);
}

TEST(Router, BiasChoosesButDoesNotWeigh) {
  // 8 experts, one group, top 2. All logits 0 (score 0.5); the bias alone orders them: 5 then 2.
  const RouterConfig c = small_config(8, 1, 1, 2);
  const std::vector<double> logits(8, 0.0);
  const std::vector<float> bias = {0.0f, 0.1f, 0.3f, -0.2f, 0.0f, 0.5f, 0.2f, 0.1f};
  std::vector<int32_t> ids(2);
  std::vector<double> w(2);
  grouped_topk_reference(logits.data(), 1, bias.data(), c, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{5, 2}));
  EXPECT_DOUBLE_EQ(w[0], 1.25);  // 0.5 / (0.5 + 0.5) * 2.5: unbiased scores
  EXPECT_DOUBLE_EQ(w[1], 1.25);
}

TEST(Router, DroppedGroupsNeverWinEvenAgainstNegativeScores) {
  // 8 experts, 2 groups of 4, keep 1, top 2, logits 0 (score 0.5), every biased score negative:
  //   group 0 bias -1.0 -0.8 -1.2 -0.9 -> biased -0.5 -0.3 -0.7 -0.4, group score -0.7
  //   group 1 bias -0.9 -2 -2 -2       -> biased -0.4 -1.5 -1.5 -1.5, group score -1.9
  // Group 0 is kept; its best experts are 1 and 3. HF's masked_fill(0.0) would let the dropped group's
  // experts (masked to 0.0 > -0.3) win; pcpkv masks to -inf like vLLM and SGLang.
  const RouterConfig c = small_config(8, 2, 1, 2);
  const std::vector<double> logits(8, 0.0);
  const std::vector<float> bias = {-1.0f, -0.8f, -1.2f, -0.9f, -0.9f, -2.0f, -2.0f, -2.0f};
  std::vector<int32_t> ids(2);
  std::vector<double> w(2);
  grouped_topk_reference(logits.data(), 1, bias.data(), c, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 3}));
}

TEST(Router, TiesGoToTheLowerIndexAndBf16LogitsCreateThem) {
  // Two experts; logit 1 + 2^-9 rounds to bf16 1.0, so with bf16 logits the two tie and expert 0 wins;
  // with fp32 logits expert 1 is larger.
  RouterConfig c = small_config(2, 1, 1, 1);
  const std::vector<double> logits = {1.0, 1.0 + std::ldexp(1.0, -9)};
  int32_t id = -1;
  double w = 0;
  grouped_topk_reference(logits.data(), 1, nullptr, c, &id, &w);
  EXPECT_EQ(id, 1);
  c.logits_bf16 = true;
  grouped_topk_reference(logits.data(), 1, nullptr, c, &id, &w);
  EXPECT_EQ(id, 0);
  // Equal group scores: the lower group is kept.
  const RouterConfig g = small_config(8, 2, 1, 1);
  const std::vector<double> flat(8, 0.25);
  grouped_topk_reference(flat.data(), 1, nullptr, g, &id, &w);
  EXPECT_EQ(id, 0);
  const auto gaps = routing_decision_gaps(flat.data(), 1, nullptr, g);
  EXPECT_EQ(gaps[0].group_gap, 0.0);
  EXPECT_EQ(gaps[0].expert_gap, 0.0);
}

TEST(Router, FloatAndDoubleLogitsAgreeOnRandomTokens) {
  const RouterConfig c = router_config(preset("deepseek-v3.2"));
  const int64_t T = 16;
  std::vector<float> lf(T * c.n_experts);
  std::vector<double> ld(lf.size());
  for (size_t i = 0; i < lf.size(); ++i) {
    lf[i] = static_cast<float>(static_cast<int64_t>(test::hash64(7, i) % 20001) - 10000) * 1e-3f;
    ld[i] = lf[i];
  }
  std::vector<int32_t> a(T * c.top_k), b(a.size());
  std::vector<double> wa(a.size()), wb(a.size());
  grouped_topk_reference(lf.data(), T, nullptr, c, a.data(), wa.data());
  grouped_topk_reference(ld.data(), T, nullptr, c, b.data(), wb.data());
  EXPECT_EQ(a, b);
  EXPECT_EQ(wa, wb);
  for (int64_t t = 0; t < T; ++t) {
    const std::set<int32_t> distinct(a.begin() + t * c.top_k, a.begin() + (t + 1) * c.top_k);
    EXPECT_EQ(static_cast<int64_t>(distinct.size()), c.top_k);
    // At most topk_group distinct groups.
    std::set<int32_t> groups;
    for (int32_t e : distinct) groups.insert(e / static_cast<int32_t>(c.n_experts / c.n_group));
    EXPECT_LE(static_cast<int64_t>(groups.size()), c.topk_group);
  }
}

TEST(Router, DispatchTableIsWellFormed) {
  const auto& table = router_dispatch_table();
  ASSERT_FALSE(table.empty());
  EXPECT_EQ(table.back().max_tokens, INT32_MAX);
  for (size_t i = 0; i < table.size(); ++i) {
    if (i > 0) {
      EXPECT_GT(table[i].max_tokens, table[i - 1].max_tokens);
    }
    EXPECT_NE(table[i].path, RouterPath::kAuto);
    if (table[i].path == RouterPath::kSmallT) {
      EXPECT_LE(table[i].max_tokens, kRouterSmallMaxTokens);
      const int e = table[i].experts_per_cta;
      EXPECT_TRUE(e == 1 || e == 2 || e == 4 || e == 8) << e;
      EXPECT_NE(table[i].kernel, RouterSmallKernel::kAuto);
      if (table[i].kernel == RouterSmallKernel::kStaged) {
        EXPECT_LE(table[i].max_tokens, kRouterStagedMaxTokens);  // the built staged kernels
      } else {
        EXPECT_LE(e * router_token_bucket(table[i].max_tokens), 64);  // the built row-loop kernels
      }
      EXPECT_EQ(256 % e, 0);
    }
  }
  // Measured on the H200 (src/serving/drivers/router_dispatch.cpp): the small-T kernel at T = 1, cuBLASLt from
  // T = 8 on.
  EXPECT_EQ(router_dispatch(1).path, RouterPath::kSmallT);
  EXPECT_EQ(router_dispatch(64).path, RouterPath::kCublasLt);
  EXPECT_EQ(parse_router_small_kernel("small2"), RouterSmallKernel::kStaged);
  EXPECT_EQ(std::string(to_string(RouterSmallKernel::kRowLoop)), "small");
  EXPECT_NE(error_of([] { parse_router_small_kernel("small3"); }).find("'small3'"), std::string::npos);
  for (int64_t t = 1; t <= 4096; t = t * 3 / 2 + 1) EXPECT_NO_THROW(router_dispatch(t));
  EXPECT_EQ(router_token_bucket(1), 1);
  EXPECT_EQ(router_token_bucket(3), 4);
  EXPECT_EQ(router_token_bucket(17), 32);
  EXPECT_THROW(router_token_bucket(33), Error);
  EXPECT_THROW(router_dispatch(0), Error);
  EXPECT_EQ(parse_router_path("cublaslt"), RouterPath::kCublasLt);
  EXPECT_NE(error_of([] { parse_router_path("gemv"); }).find("'gemv'"), std::string::npos);
  EXPECT_EQ(router_logit_bound_factor(RouterPath::kSmallT, 6144), 8.0 * 6 + 8);
  EXPECT_EQ(router_logit_bound_factor(RouterPath::kCublasLt, 7168), 2.0 * 7168);
}

// A huge router path or small-T kernel name was quoted whole (100 KB in, a 100 KB message out): clipped
// (input_limits.h clip), what it names and the known names still in the message.
TEST(Router, UnknownPathAndKernelNamesAreQuotedClipped) {
  const std::string huge(100000, 'g');
  test::expect_clipped_error(error_of([&] { parse_router_path(huge); }), "router path: 'ggg",
                             "is not one of auto, small, cublaslt");
  test::expect_clipped_error(error_of([&] { parse_router_small_kernel(huge); }), "router small-T kernel: 'ggg",
                             "is not one of auto, small, small2");
}

// ---- FP8 per-token-group quantization ----

struct QuantCase {
  Fp8ScaleFormat format;
  bool bytes;
  bool column_major;
};

TEST(Fp8GroupQuant, ScalesAndBytesWithinE4m3Bounds) {
  const int64_t T = 5, H = 512, G = H / kFp8QuantGroup, stride = H + 8;
  std::vector<uint16_t> x = test::random_bf16(T, stride, 11);
  // One group entirely tiny: the 1e-4 clamp decides its scale.
  for (int64_t k = 0; k < kFp8QuantGroup; ++k) x[2 * stride + kFp8QuantGroup + k] = codec::float_to_bf16(1e-6f);
  std::vector<std::vector<uint8_t>> q_by_case;
  std::vector<std::vector<float>> s_by_case;
  for (const QuantCase qc : {QuantCase{Fp8ScaleFormat::kFp32, false, false}, QuantCase{Fp8ScaleFormat::kUe8m0, false, false},
                             QuantCase{Fp8ScaleFormat::kUe8m0, true, false}, QuantCase{Fp8ScaleFormat::kUe8m0, true, true}}) {
    Fp8GroupQuantParams p;
    p.num_tokens = T;
    p.hidden = H;
    p.x = x.data();
    p.x_stride = stride;
    std::vector<uint8_t> q(T * H, 0xA5);
    std::vector<float> sf(T * G, -1.0f);
    std::vector<uint8_t> sb(T * G, 0xA5);
    p.q = q.data();
    p.scales = qc.bytes ? static_cast<void*>(sb.data()) : static_cast<void*>(sf.data());
    p.format = qc.format;
    p.scales_ue8m0_bytes = qc.bytes;
    if (qc.column_major) {
      p.scale_token_stride = 1;
      p.scale_group_stride = T;
    }
    fp8_group_quant_reference(p);
    std::vector<float> scale(T * G);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t si = t * fp8_scale_token_stride(p) + g * p.scale_group_stride;
        scale[t * G + g] = qc.bytes ? std::ldexp(1.0f, static_cast<int>(sb[si]) - 127) : sf[si];
      }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < G; ++g) {
        double amax = 0;
        for (int64_t k = 0; k < kFp8QuantGroup; ++k)
          amax = std::max(amax, std::fabs(double{codec::bf16_to_float(x[t * stride + g * kFp8QuantGroup + k])}));
        const double clamped = std::max(amax, 1e-4);
        const float s = scale[t * G + g];
        if (qc.format == Fp8ScaleFormat::kFp32) {
          // fp32 division is correctly rounded; so is the double quotient rounded to float.
          EXPECT_EQ(s, static_cast<float>(static_cast<double>(static_cast<float>(clamped)) / 448.0));
        } else {
          int e = 0;
          EXPECT_EQ(std::frexp(s, &e), 0.5f) << "power of two";
          EXPECT_GE(s, clamped / 448.0);
          EXPECT_LT(s / 2, clamped / 448.0);  // the smallest such power
        }
        for (int64_t k = 0; k < kFp8QuantGroup; ++k) {
          const double xv = codec::bf16_to_float(x[t * stride + g * kFp8QuantGroup + k]);
          const double dq = static_cast<double>(codec::e4m3_to_float(q[t * H + g * kFp8QuantGroup + k])) * s;
          EXPECT_LE(std::fabs(dq - xv), std::ldexp(std::fabs(xv), -4) + std::ldexp(double{s}, -10))
              << "t " << t << " g " << g << " k " << k;
        }
      }
    q_by_case.push_back(q);
    s_by_case.push_back(scale);

    // The consumer: y = bf16(e4m3 * s), one rounding; within the same bound (+ bf16 half ulp) of x.
    std::vector<uint16_t> y(T * H, 0xA5A5);
    fp8_group_dequant_reference(p, y.data());
    for (int64_t i = 0; i < T * H; ++i) {
      const float s = scale[(i / H) * G + (i % H) / kFp8QuantGroup];
      EXPECT_EQ(y[i], codec::float_to_bf16(codec::e4m3_to_float(q[i]) * s));
    }
  }
  // UE8M0 as fp32 or as bytes, row- or column-major: the same bytes and scales.
  EXPECT_EQ(q_by_case[1], q_by_case[2]);
  EXPECT_EQ(q_by_case[2], q_by_case[3]);
  EXPECT_EQ(s_by_case[1], s_by_case[2]);
  EXPECT_EQ(s_by_case[2], s_by_case[3]);
}

TEST(Fp8GroupQuant, ValidationNamesTheField) {
  std::vector<uint16_t> x(256, 0x3f80);
  std::vector<uint8_t> q(256);
  std::vector<float> s(2);
  Fp8GroupQuantParams p;
  p.num_tokens = 1;
  p.hidden = 200;
  p.x = x.data();
  p.x_stride = 256;
  p.q = q.data();
  p.scales = s.data();
  EXPECT_NE(error_of([&] { fp8_group_quant_reference(p); }).find("hidden = 200"), std::string::npos);
  p.hidden = 256;
  p.x_stride = 128;
  EXPECT_NE(error_of([&] { fp8_group_quant_reference(p); }).find("x_stride = 128"), std::string::npos);
  p.x_stride = 256;
  p.format = Fp8ScaleFormat::kFp32;
  p.scales_ue8m0_bytes = true;
  EXPECT_NE(error_of([&] { fp8_group_quant_reference(p); }).find("ue8m0"), std::string::npos);
  p.scales_ue8m0_bytes = false;
  p.scale_group_stride = 0;
  EXPECT_NE(error_of([&] { fp8_group_quant_reference(p); }).find("scale_group_stride"), std::string::npos);
}

}  // namespace
}  // namespace pcpkv
