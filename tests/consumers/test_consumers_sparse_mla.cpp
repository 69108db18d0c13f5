// pcpkv-test-labels: unit
// The CPU sparse MLA reference (pcpkv/consumers/sparse_mla.h) against a naive long-double softmax over rows
// decoded by pcpkv/publish/checks.h's decode_slot (an independent decoder), for every cache format.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"
#include "pcpkv/consumers/sparse_mla.h"
#include "pcpkv/publish/checks.h"
#include "support/consumers_fixture.h"
#include "support/error_of.h"

namespace pcpkv {
namespace {

using test::AttentionCase;
using test::bits_of;
using test::format_of;

constexpr double kU = 1.0 / 16777216.0;

/// Naive attention of (token t, head h) in long double from decode_slot rows.
void naive(const AttentionCase& c, int64_t t, int h, std::vector<long double>& out, long double& lse) {
  std::vector<long double> s;
  std::vector<DecodedRow> rows;
  for (int i = 0; i < c.topk; ++i) {
    const int32_t slot = c.indices[t * c.topk + i];
    if (slot < 0) continue;
    rows.push_back(decode_slot(c.cache.data(), c.geometry, nullptr, IndexerCacheGeometry{}, c.fmt, slot));
  }
  out.assign(512, 0.0L);
  if (rows.empty()) {
    lse = -std::numeric_limits<long double>::infinity();
    return;
  }
  const uint16_t* q = &c.q[(t * c.num_heads + h) * 576];
  long double m = -std::numeric_limits<long double>::infinity();
  for (const DecodedRow& r : rows) {
    long double dot = 0.0L;
    for (int d = 0; d < 512; ++d) dot += (long double)codec::bf16_to_float(q[d]) * r.kv_c[d];
    for (int d = 0; d < 64; ++d) dot += (long double)codec::bf16_to_float(q[512 + d]) * r.k_pe[d];
    s.push_back(dot * (long double)c.softmax_scale);
    m = std::max(m, s.back());
  }
  long double l = 0.0L;
  for (size_t j = 0; j < rows.size(); ++j) {
    const long double e = std::exp(s[j] - m);
    l += e;
    for (int d = 0; d < 512; ++d) out[d] += e * rows[j].kv_c[d];
  }
  for (auto& v : out) v /= l;
  lse = m + std::log(l);
}

struct FormatParam {
  KvFormat kv;
  DsMlaScale scale;
};

class ConsumersSparseMla : public ::testing::TestWithParam<FormatParam> {};

TEST_P(ConsumersSparseMla, MatchesNaiveLongDouble) {
  AttentionCase c;
  c.fmt = format_of(GetParam().kv, GetParam().scale);
  c.num_heads = 3;
  c.num_tokens = 4;
  c.topk = 48;
  c.build();
  std::fill(c.indices.begin() + 3 * c.topk, c.indices.end(), -1);  // token 3: no valid key
  SparseMlaParams p = c.params();
  SparseMlaRefStats stats;
  sparse_mla_reference(p, &stats);
  int64_t checked = 0;
  for (int64_t t = 0; t < c.num_tokens; ++t)
    for (int h = 0; h < c.num_heads; ++h) {
      std::vector<long double> out;
      long double lse;
      naive(c, t, h, out, lse);
      const int64_t th = t * c.num_heads + h;
      if (std::isinf(lse)) {
        EXPECT_EQ(c.lse[th], -std::numeric_limits<float>::infinity());
        for (int d = 0; d < 512; ++d) ASSERT_EQ(bits_of(c.out[th * 512 + d]), 0u) << "empty row must be +0";
        EXPECT_EQ(stats.num_keys[t], 0);
        continue;
      }
      // fp64 accumulation rounded once: within 2u of the exact value (+ fp64 noise on the weighted sum).
      EXPECT_LE(std::fabs(c.lse[th] - lse), 2 * kU * std::fabs(lse) + 1e-12) << t << " " << h;
      for (int d = 0; d < 512; ++d) {
        const double tol = 2 * kU * std::fabs((double)out[d]) + 1e-12 * stats.abs_pv[th * 512 + d] + 1e-30;
        ASSERT_LE(std::fabs(c.out[th * 512 + d] - (double)out[d]), tol) << t << " " << h << " " << d;
        ++checked;
      }
    }
  EXPECT_GT(checked, 3000);
}

INSTANTIATE_TEST_SUITE_P(Formats, ConsumersSparseMla,
                         ::testing::Values(FormatParam{KvFormat::kBf16, DsMlaScale::kPow2},
                                           FormatParam{KvFormat::kFp8, DsMlaScale::kPow2},
                                           FormatParam{KvFormat::kFp8DsMla, DsMlaScale::kPow2},
                                           FormatParam{KvFormat::kFp8DsMla, DsMlaScale::kRaw}),
                         [](const auto& info) {
                           return std::string(to_string(info.param.kv)) + "_" + to_string(info.param.scale);
                         });

// -1 entries are skipped: the same keys compacted give the same bits.
TEST(ConsumersSparseMlaRef, MinusOneEntriesAreSkipped) {
  AttentionCase c;
  c.fmt = format_of(KvFormat::kFp8DsMla);
  c.minus_one_rate = 0.4;
  c.build();
  SparseMlaParams p = c.params();
  sparse_mla_reference(p);
  const std::vector<float> out = c.out, lse = c.lse;
  AttentionCase d = c;
  for (int64_t t = 0; t < d.num_tokens; ++t) {
    auto b = d.indices.begin() + t * d.topk;
    std::stable_partition(b, b + d.topk, [](int32_t v) { return v >= 0; });
  }
  SparseMlaParams q = d.params();
  sparse_mla_reference(q);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(bits_of(out[i]), bits_of(d.out[i])) << i;
  for (size_t i = 0; i < lse.size(); ++i) ASSERT_EQ(bits_of(lse[i]), bits_of(d.lse[i])) << i;
}

// scales_as_bf16 (FlashMLA's SM90 reader view) reads exactly the cache whose tile scales were rounded to bf16
// in place; pow2 scales are bf16-exact (the same bits as the fp32 read), raw ones are not.
TEST(ConsumersSparseMlaRef, ScalesAsBf16ReadsTheBf16RoundedScales) {
  for (DsMlaScale mode : {DsMlaScale::kPow2, DsMlaScale::kRaw}) {
    AttentionCase c;
    c.fmt = format_of(KvFormat::kFp8DsMla, mode);
    c.build();
    SparseMlaParams p = c.params();
    sparse_mla_reference(p);
    const std::vector<float> out32 = c.out;
    p = c.params();
    p.scales_as_bf16 = true;
    sparse_mla_reference(p);
    AttentionCase r = c;
    test::round_tile_scales_to_bf16(r);
    SparseMlaParams q = r.params();
    sparse_mla_reference(q);
    size_t moved = 0;
    for (size_t i = 0; i < c.out.size(); ++i) {
      ASSERT_EQ(bits_of(c.out[i]), bits_of(r.out[i])) << to_string(mode) << " " << i;
      moved += bits_of(c.out[i]) != bits_of(out32[i]);
    }
    for (size_t i = 0; i < c.lse.size(); ++i) ASSERT_EQ(bits_of(c.lse[i]), bits_of(r.lse[i])) << i;
    if (mode == DsMlaScale::kPow2)
      EXPECT_EQ(moved, 0u);
    else
      EXPECT_GT(moved, c.out.size() / 2) << "raw scales read through bf16 must move the output";
  }
}

TEST(ConsumersSparseMlaRef, BadIndexThrowsBeforeWriting) {
  AttentionCase c;
  c.fmt = format_of(KvFormat::kBf16);
  c.build();
  c.indices[1 * c.topk + 7] = static_cast<int32_t>(c.geometry.num_slots());
  SparseMlaParams p = c.params();
  try {
    sparse_mla_reference(p);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("indices[1, 7] = {} is out of range [-1, {})",
                                                     c.geometry.num_slots(), c.geometry.num_slots())),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(std::all_of(c.out.begin(), c.out.end(), [](float v) { return v == 1234.5f; }));
  c.indices[1 * c.topk + 7] = -2;
  p = c.params();
  EXPECT_THROW(sparse_mla_reference(p), Error);
  c.indices[1 * c.topk + 7] = 0;
  p = c.params();
  p.softmax_scale = 0.0f;
  EXPECT_THROW(sparse_mla_reference(p), Error);
  p.softmax_scale = 0.1f;
  p.num_heads = 0;
  EXPECT_THROW(sparse_mla_reference(p), Error);
}

TEST(ConsumersSparseMlaRef, BoundGrowsWithKeysScoresAndShards) {
  const double a = SparseMlaBound::out_bound(1.0, 10.0, 64, 0.5, 3.0);
  EXPECT_GT(a, 0.0);
  EXPECT_LT(a, 1e-3);
  EXPECT_GT(SparseMlaBound::out_bound(1.0, 10.0, 2048, 0.5, 3.0), a);
  EXPECT_GT(SparseMlaBound::out_bound(1.0, 100.0, 64, 0.5, 3.0), a);
  EXPECT_GT(SparseMlaBound::out_bound(1.0, 10.0, 64, 0.5, 3.0, 4), a);
  EXPECT_GT(SparseMlaBound::lse_bound(10.0, 64, 3.0, 4), SparseMlaBound::lse_bound(10.0, 64, 3.0));
}

// The tensor-core arithmetic's bound: wider than fp32's, and at least the bf16 weight rounding (2^-9).
TEST(ConsumersSparseMlaRef, MmaBoundCoversTheBf16WeightsAndTruncatingSums) {
  const SparseMlaArith m = SparseMlaArith::kBf16Mma;
  EXPECT_EQ(arith_of(SparseMlaKernel::kMma), m);
  EXPECT_EQ(arith_of(SparseMlaKernel::kSimt), SparseMlaArith::kFp32);
  const double fp32 = SparseMlaBound::out_bound(1.0, 10.0, 64, 0.5, 3.0);
  const double mma = SparseMlaBound::out_bound(1.0, 10.0, 64, 0.5, 3.0, 0, m);
  EXPECT_GT(mma, fp32 + 1.0 / 256.0);  // rho = 2^-8 + u: bf16 rounds to 8 significant bits
  EXPECT_LT(mma, 2e-2);
  // delta = (4 * 576 + 16) u max_abs_s: with tiny scores the weights' rounding dominates
  const double u = 1.0 / 16777216.0;
  EXPECT_NEAR(SparseMlaBound::out_bound(1.0, 0.0, 1, 0.0, 0.0, 0, m), 2.0 * (2 + 16 + 64) * u + 1.0 / 256 + u, 1e-12);
  EXPECT_NEAR(SparseMlaBound::lse_bound(1.0, 1, 0.0, 0, m), (4.0 * 576 + 16) * u + 2.0 * (2 + 16 + 64) * u, 1e-15);
  EXPECT_GT(SparseMlaBound::out_bound(1.0, 10.0, 64, 0.5, 3.0, 4, m), mma);
  EXPECT_GT(SparseMlaBound::lse_bound(10.0, 64, 3.0, 0, m), SparseMlaBound::lse_bound(10.0, 64, 3.0));
  EXPECT_STREQ(to_string(SparseMlaKernel::kMma), "mma");
  EXPECT_STREQ(to_string(SparseMlaKernel::kSimt), "simt");
}

// softmax_scale arrives as a double (the model config, a Python float) and the kernels read a float32: a bare cast
// made 1e300 inf and 1e-50 zero, and the error then named the float (or, for a subnormal, there was none).
TEST(ConsumersSparseMlaRef, SoftmaxScaleIsCheckedAsGivenBeforeTheFloat32Cast) {
  EXPECT_EQ(sparse_mla_softmax_scale(0.135234), 0.135234f);
  EXPECT_EQ(sparse_mla_softmax_scale(0.0625), 0.0625f);
  for (const auto& [bad, shown] : std::vector<std::pair<double, std::string>>{
           {1e300, "1e+300"}, {1e-50, "1e-50"}, {1e39, "1e+39"}, {1e-40, "1e-40"}, {0.0, "0"}, {-1.0, "-1"},
           {static_cast<double>(NAN), "nan"}, {static_cast<double>(INFINITY), "inf"}}) {
    EXPECT_EQ(test::error_of([&] { sparse_mla_softmax_scale(bad); }),
              "sparse_mla: softmax_scale = " + shown +
                  " must be a finite, positive, normal float32 (in [2^-126, 3.4e38]; 0, negatives, subnormals such "
                  "as 1e-45, nan and inf are refused)");
  }
}

// The reference's validation follows the same rules on the float32 fields: a subnormal softmax_scale or fp8
// k_scale passed it.
TEST(ConsumersSparseMlaRef, SubnormalScalesAreRefused) {
  AttentionCase c;
  c.fmt = format_of(KvFormat::kFp8);
  c.build();
  SparseMlaParams p = c.params();
  p.softmax_scale = 1e-40f;
  EXPECT_NE(test::error_of([&] { sparse_mla_reference(p); }).find("sparse_mla: softmax_scale = 1e-40 must be"),
            std::string::npos);
  p = c.params();
  p.fmt.k_scale = 1e-45f;
  EXPECT_NE(test::error_of([&] { sparse_mla_reference(p); }).find("sparse_mla: k_scale = 1e-45 must be"),
            std::string::npos);
  EXPECT_TRUE(std::all_of(c.out.begin(), c.out.end(), [](float v) { return v == 1234.5f; }));
}

TEST(ConsumersSparseMlaRef, SoftmaxScaleOfThePresets) {
  EXPECT_NEAR(preset("deepseek-v3.2").softmax_scale(), 0.135234, 1e-6);
  EXPECT_DOUBLE_EQ(preset("glm-5").softmax_scale(), 0.0625);
}

}  // namespace
}  // namespace pcpkv
