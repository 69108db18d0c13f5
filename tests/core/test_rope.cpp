// pcpkv-test-labels: unit
// RoPE tables (SPEC section 1) against long double evaluations of the SPEC formulas.
#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/rope.h"

namespace pcpkv {
namespace {

constexpr long double kPi = 3.141592653589793238462643383279502884L;

// SPEC: corr(r) = 64*ln(4096/(2*pi*r)) / (2*ln theta); low = floor(corr(32)), high = ceil(corr(1)).
TEST(Rope, DeepseekYarnCorrectionRange) {
  const long double theta = 10000.0L;
  auto corr = [&](long double r) { return 64 * std::log(4096 / (2 * kPi * r)) / (2 * std::log(theta)); };
  EXPECT_EQ(std::floor(corr(32)), 10.0L);
  EXPECT_EQ(std::ceil(corr(1)), 23.0L);

  const ModelConfig m = preset("deepseek-v3.2");
  const auto f = rope_inv_freq(m.rope);
  for (int i = 0; i < 32; ++i) {
    const long double base = std::pow(theta, -2.0L * i / 64);
    const long double ramp = std::clamp((i - 10.0L) / (23.0L - 10.0L), 0.0L, 1.0L);
    const long double expect = base / 40 * ramp + base * (1 - ramp);
    EXPECT_NEAR(static_cast<double>(f[i] / expect), 1.0, 1e-15) << "pair " << i;
  }
  EXPECT_EQ(f[0], 1.0L);                                              // i <= low: unscaled
  EXPECT_NEAR(static_cast<double>(f[31] / (std::pow(theta, -62.0L / 64) / 40)), 1.0, 1e-15);  // i >= high: /40
  EXPECT_EQ(rope_mscale(m.rope), 1.0L);  // mscale == mscale_all_dim
}

TEST(Rope, TableMatchesLongDouble) {
  for (const char* name : {"deepseek-v3.2", "glm-5"}) {
    const ModelConfig m = preset(name);
    const RopeTable t = make_rope_table(m.rope, 40000);
    const auto f = rope_inv_freq(m.rope);
    int64_t checked = 0;
    for (int64_t pos : {0, 1, 2, 17, 4095, 4096, 32767, 39999}) {
      for (int i = 0; i < 32; ++i) {
        const long double a = pos * f[i];
        const float c = t.row(pos)[i], s = t.row(pos)[32 + i];
        // Rounded once from long double: within half a float ulp of the exact value. (ilogb(0) is INT_MIN:
        // 0 needs its own bound, UBSan caught INT_MIN - 23.)
        auto half_ulp = [](float x) { return x == 0 ? 0.0L : 0.5L * std::ldexp(1.0L, std::ilogb(x) - 23); };
        EXPECT_LE(std::fabs(c - std::cos(a)), half_ulp(c) + 1e-30L) << name << pos << i;
        EXPECT_LE(std::fabs(s - std::sin(a)), half_ulp(s) + 1e-30L) << name << pos << i;
        long double ec, es;
        rope_exact(m.rope, pos, i, &ec, &es);
        EXPECT_EQ(static_cast<float>(ec), c);
        EXPECT_EQ(static_cast<float>(es), s);
        ++checked;
      }
    }
    EXPECT_EQ(checked, 8 * 32);
    EXPECT_EQ(t.row(0)[0], 1.0f);
    EXPECT_EQ(t.row(0)[32], 0.0f);
  }
}

TEST(Rope, DefaultUsesConfigTheta) {
  RopeConfig r;
  r.theta = 8e6;
  const auto f = rope_inv_freq(r);
  EXPECT_NEAR(static_cast<double>(f[16]), std::pow(8e6, -0.5), 1e-18);
}

TEST(Rope, RejectsEmptyTable) { EXPECT_THROW(make_rope_table(RopeConfig{}, 0), Error); }

}  // namespace
}  // namespace pcpkv
