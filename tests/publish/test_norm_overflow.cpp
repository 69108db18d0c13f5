// pcpkv-test-labels: unit
// Rows whose norms overflow fp32 (SPEC 2.1, 2.2, 2.4): finite bf16 activations up to the
// bf16 maximum (~2^128) are normalized from x * 2^-72 (the overflow guard of pcpkv/device/token_math.h)
// instead of being published as zeros. The published rows must equal the fp64 math of SPEC section 2 within
// the FP8 bound (publish/checks.h), q_c_out within the bf16 bound; rows with a NaN / inf input keep today's result.
#include <cfloat>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/token_math.h"
#include "pcpkv/publish/checks.h"
#include "support/huge_rows.h"
#include "support/publish_case.h"

namespace pcpkv {
namespace {

TEST(NormOverflow, GuardHelpers) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(math::finite(FLT_MAX));
  EXPECT_TRUE(math::finite(-FLT_MAX));
  EXPECT_FALSE(math::finite(inf));
  EXPECT_FALSE(math::finite(-inf));
  EXPECT_FALSE(math::finite(nan));
  EXPECT_TRUE(math::use_rescaled(inf, 1.0f));
  EXPECT_TRUE(math::use_rescaled(nan, 1.0f));  // (+inf) + (-inf) partial sums of a finite row
  EXPECT_FALSE(math::use_rescaled(1.0f, 2.0f));
  EXPECT_FALSE(math::use_rescaled(inf, inf));  // an inf / NaN input keeps the ordinary result
  EXPECT_FALSE(math::use_rescaled(nan, nan));
  EXPECT_EQ(math::kRescale, std::ldexp(1.0f, -72));
  EXPECT_EQ(math::rescaled_eps(std::ldexp(1.0f, 20)), std::ldexp(1.0f, -124));  // exact
  EXPECT_EQ(math::rescaled_eps(1e-6f), 0.0f);  // 1e-6 * 2^-144 underflows: far below any rescaled mean square
  // The bound the guard relies on: 4096 squares of the rescaled bf16 maximum stay finite.
  const float big = codec::bf16_to_float(0x7f7f) * math::kRescale;
  EXPECT_TRUE(math::finite(4096.0f * (big * big)));
  EXPECT_FALSE(math::finite(codec::bf16_to_float(0x7f7f) * codec::bf16_to_float(0x7f7f)));
}

// fp64 RMSNorm of one row: x / sqrt(mean(x^2) + eps) * w (SPEC 2.1).
std::vector<double> rms_fp64(const uint16_t* x, int64_t n, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += std::pow(static_cast<double>(codec::bf16_to_float(x[i])), 2);
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
  std::vector<double> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = codec::bf16_to_float(x[i]) * r * w[static_cast<size_t>(i)];
  return y;
}

struct FormatCase {
  const char* name;
  KvFormat format;
  bool has_indexer;
  const char* model;
};

class NormOverflowFormats : public ::testing::TestWithParam<FormatCase> {};

TEST_P(NormOverflowFormats, HugeRowsPublishTheFp64Values) {
  const FormatCase& fc = GetParam();
  test::CaseSpec spec;
  spec.model = fc.model;
  spec.pcp = 2;
  spec.requests = {{RequestKind::kPrefill, 29, 0}, {RequestKind::kDecode, 1, 7}};
  spec.fmt.kv_format = fc.format;
  spec.fmt.has_indexer = fc.has_indexer;
  if (fc.format == KvFormat::kFp8) spec.fmt.k_scale = 0.0213f;
  auto c = test::make_case(spec);
  const std::vector<int64_t> huge = test::make_rows_huge(c->inputs);
  ASSERT_GE(huge.size(), static_cast<size_t>(test::kHugeRowKinds));
  auto cpu = make_cpu_backend(2);
  for (Transport t : {Transport::kDirect, Transport::kStaging, Transport::kCollect}) {
    SCOPED_TRACE(fmt::format("{} {}", fc.name, to_string(t)));
    const PublishResult r = cpu->publish(c->setup, c->inputs, t);
    for (int32_t rank = 0; rank < spec.pcp; ++rank) {
      const Fp8Report f = check_fp8_bound(r, rank, c->inputs, c->plan, c->model, spec.fmt, t == Transport::kCollect);
      EXPECT_GT(f.num_values, 0);
      EXPECT_EQ(f.num_over_bound, 0) << "rank " << rank << ": max err/bound " << f.max_err_over_bound << ", worst "
                                     << f.worst;
    }
    // q_c_out (stays local): the bf16 of the fp64 RMSNorm, |err| <= 2^-8 |exact| + 2^-16 amax (checks.h's bf16 rule).
    const int64_t q = c->inputs.q_lora_rank;
    for (int32_t rank = 0; rank < spec.pcp; ++rank) {
      const RankPlan& rp = c->plan.ranks[static_cast<size_t>(rank)];
      for (size_t i = 0; i < rp.global_index.size(); ++i) {
        const int64_t g = rp.global_index[i];
        if (g < 0) continue;
        const std::vector<double> want =
            rms_fp64(c->inputs.q_c.data() + g * q, q, c->inputs.weights.q_norm_w, static_cast<float>(c->model.rms_norm_eps));
        double amax = 0;
        for (double v : want) amax = std::max(amax, std::fabs(v));
        int bad = 0;
        for (int64_t k = 0; k < q && bad < 3; ++k) {
          const double got = codec::bf16_to_float(r.q_c_out[static_cast<size_t>(rank)][i * q + k]);
          const double e = want[static_cast<size_t>(k)];
          if (!(std::fabs(got - e) <= std::ldexp(std::fabs(e), -8) + std::ldexp(amax, -16))) {
            ADD_FAILURE() << "q_c_out of token " << g << " [" << k << "] = " << got << ", fp64 " << e;
            ++bad;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, NormOverflowFormats,
                         ::testing::Values(FormatCase{"glm5_fp8_ds_mla", KvFormat::kFp8DsMla, true, "glm-5"},
                                           FormatCase{"deepseek_fp8", KvFormat::kFp8, true, "deepseek-v3.2"},
                                           FormatCase{"glm5_bf16_shared", KvFormat::kBf16, false, "glm-5"}),
                         [](const ::testing::TestParamInfo<FormatCase>& info) { return std::string(info.param.name); });

// A row with an inf or NaN input is not rescaled (its rescaled sums are not finite either): it keeps the
// ordinary result, r = 1/sqrt(inf) = 0 (inf -> NaN, the rest +-0) resp. NaN everywhere.
TEST(NormOverflow, NonFiniteInputsKeepTheOrdinaryResult) {
  constexpr int64_t T = 2;
  std::vector<uint16_t> kv(T * 512, codec::float_to_bf16(3.0f)), k_pe(T * 64, codec::float_to_bf16(1.0f));
  std::vector<uint16_t> index_k(T * 128, codec::float_to_bf16(-2.0f));
  kv[5] = 0x7f80;               // +inf
  kv[512 + 7] = 0x7fc0;         // NaN
  index_k[9] = 0xff80;          // -inf
  for (int i = 0; i < 128; i += 2) index_k[128 + i] = codec::float_to_bf16(1e30f);  // finite, overflowing
  std::vector<float> w(512, 0.5f), lw(128, 1.0f), lb(128, 0.0f), cs(64, 0.0f);
  for (int i = 0; i < 32; ++i) cs[static_cast<size_t>(i)] = 1.0f;  // position 0: cos 1, sin 0
  std::vector<int64_t> pos(T, 0);
  std::vector<uint16_t> kv_out(T * 512, 0x1234), idx_out(T * 128, 0x1234);
  DispatchParams p;
  p.num_tokens = T;
  p.kv = kv.data();
  p.k_pe = k_pe.data();
  p.index_k = index_k.data();
  p.positions = pos.data();
  p.kv_norm_w = w.data();
  p.index_ln_w = lw.data();
  p.index_ln_b = lb.data();
  p.rope_cos_sin = cs.data();
  p.rope_num_positions = 1;
  p.kv_c_out = kv_out.data();
  p.index_k_out = idx_out.data();
  dispatch_reference(p);
  auto is_nan = [](uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0; };
  for (int i = 0; i < 512; ++i) {
    if (i == 5)
      EXPECT_TRUE(is_nan(kv_out[static_cast<size_t>(i)])) << "inf * 0";
    else
      EXPECT_EQ(kv_out[static_cast<size_t>(i)], 0) << "kv_c_out[" << i << "] of the row with +inf";
    EXPECT_TRUE(is_nan(kv_out[static_cast<size_t>(512 + i)])) << "kv_c_out[" << i << "] of the row with NaN";
  }
  for (int i = 0; i < 128; ++i) EXPECT_TRUE(is_nan(idx_out[static_cast<size_t>(i)])) << "index_k_out[" << i << "] (-inf)";
  // The finite row whose LayerNorm sums overflow (+-1e30 alternating with -2): d = +-~5e29, normalized to ~+-1.
  for (int i = 0; i < 128; ++i) {
    const float y = codec::bf16_to_float(idx_out[static_cast<size_t>(128 + i)]);
    EXPECT_NEAR(std::fabs(y), 1.0f, 1.0f / 64) << "index_k_out[" << i << "] of the overflowing finite row";
  }
}

}  // namespace
}  // namespace pcpkv
