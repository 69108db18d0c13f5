// RoPE cos/sin tables (SPEC section 1): default and DeepSeek-YaRN inverse frequencies in long double.
#include "pcpkv/core/rope.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "pcpkv/core/error.h"

namespace pcpkv {
namespace {

constexpr long double kPi = 3.141592653589793238462643383279502884L;

// Dimension index at which the rotation count over the original context equals num_rotations
// (DeepSeek's yarn_find_correction_dim), for the 64 rotary dims.
long double correction_dim(long double num_rotations, long double theta, long double max_pos) {
  return (kRopeDim * std::log(max_pos / (num_rotations * 2 * kPi))) / (2 * std::log(theta));
}

long double yarn_get_mscale(long double scale, long double m) {
  if (scale <= 1) return 1.0L;
  return 0.1L * m * std::log(scale) + 1.0L;
}

// Sane ranges of the RoPE parameters (SPEC section 1). Real configs: rope_theta 1e4..1e7, YaRN factor
// 4..64, beta 1..32, mscale 0.707..1. The bounds are wide; they only refuse values whose tables would
// overflow or lose all precision (mscale 1e300 gives cos * mscale = inf; mscale_all_dim < 0 can make the
// YaRN divisor 0.1 * m * ln(factor) + 1 vanish).
constexpr double kMaxRopeTheta = 1e12;
constexpr double kMaxYarnFactor = 1e4;
constexpr double kMaxYarnBeta = 1e4;
constexpr double kMaxYarnMscale = 1e3;
constexpr int64_t kMaxOriginalPositions = int64_t{1} << 40;  // the plan's bound on tokens per request
// |cos * mscale| and |sin * mscale| bound: the cache formats hold k_pe in bf16/FP8 around unit scale.
constexpr long double kMaxRopeMagnitude = 1e4L;

}  // namespace

void validate_rope(const RopeConfig& rope, const std::string& o, const std::string& prefix) {
  PCPKV_CHECK(std::isfinite(rope.theta) && rope.theta > 1 && rope.theta <= kMaxRopeTheta,
              "{}: rope_theta = {} must be in (1, {:g}]", o, rope.theta, kMaxRopeTheta);
  if (rope.scaling != RopeScaling::kDeepseekYarn) return;
  PCPKV_CHECK(std::isfinite(rope.factor) && rope.factor >= 1 && rope.factor <= kMaxYarnFactor,
              "{}: {}factor = {} must be in [1, {:g}]", o, prefix, rope.factor, kMaxYarnFactor);
  PCPKV_CHECK(rope.original_max_position_embeddings >= 1 &&
                  rope.original_max_position_embeddings <= kMaxOriginalPositions,
              "{}: {}original_max_position_embeddings = {} must be in [1, 2^40]", o, prefix,
              rope.original_max_position_embeddings);
  for (const auto& [key, v] :
       {std::pair<const char*, double>{"beta_fast", rope.beta_fast}, {"beta_slow", rope.beta_slow}}) {
    PCPKV_CHECK(std::isfinite(v) && v > 0 && v <= kMaxYarnBeta, "{}: {}{} = {} must be in (0, {:g}]", o, prefix, key,
                v, kMaxYarnBeta);
  }
  // beta_fast counts rotations at the high-frequency end of the ramp, beta_slow at the low one. Swapped,
  // the ramp (i - low) / (high - low) is still finite but inverted: it interpolates the high-frequency
  // dims and extrapolates the low ones, the opposite of YaRN; almost surely swapped keys, so refuse.
  // Equal values give a one-step ramp, which the reference handles (high += 0.001): accepted.
  PCPKV_CHECK(rope.beta_fast >= rope.beta_slow,
              "{}: {}beta_fast = {} is less than {}beta_slow = {}: YaRN needs beta_fast >= beta_slow (else the "
              "ramp is inverted; swapped keys?)",
              o, prefix, rope.beta_fast, prefix, rope.beta_slow);
  for (const auto& [key, v] :
       {std::pair<const char*, double>{"mscale", rope.mscale}, {"mscale_all_dim", rope.mscale_all_dim}}) {
    PCPKV_CHECK(std::isfinite(v) && v >= 0 && v <= kMaxYarnMscale, "{}: {}{} = {} must be in [0, {:g}]", o, prefix,
                key, v, kMaxYarnMscale);
  }
  // What the tables are built from: with the ranges above these hold, but a check here keeps any future
  // range change honest. |cos|, |sin| <= 1, so every table entry is bounded by |mscale|.
  const long double m = rope_mscale(rope);
  PCPKV_CHECK(std::isfinite(m) && m > 0 && m <= kMaxRopeMagnitude,
              "{}: the YaRN magnitude mscale(factor {}, {}mscale {}) / mscale(factor, {}mscale_all_dim {}) = {} "
              "must be finite and in (0, {:g}]",
              o, rope.factor, prefix, rope.mscale, prefix, rope.mscale_all_dim, static_cast<double>(m),
              static_cast<double>(kMaxRopeMagnitude));
  const auto f = rope_inv_freq(rope);
  for (int i = 0; i < kRopePairs; ++i) {
    PCPKV_CHECK(std::isfinite(f[i]) && f[i] > 0,
                "{}: the RoPE inverse frequency of pair {} is {} (from rope_theta {}, {}factor {}, beta_fast {}, "
                "beta_slow {})",
                o, i, static_cast<double>(f[i]), rope.theta, prefix, rope.factor, rope.beta_fast, rope.beta_slow);
  }
}


std::array<long double, kRopePairs> rope_inv_freq(const RopeConfig& rope) {
  std::array<long double, kRopePairs> f{};
  const long double theta = rope.theta;
  for (int i = 0; i < kRopePairs; ++i) f[i] = std::pow(theta, -static_cast<long double>(2 * i) / kRopeDim);
  if (rope.scaling != RopeScaling::kDeepseekYarn) return f;
  const long double max_pos = static_cast<long double>(rope.original_max_position_embeddings);
  long double low = std::floor(correction_dim(rope.beta_fast, theta, max_pos));
  long double high = std::ceil(correction_dim(rope.beta_slow, theta, max_pos));
  low = std::max<long double>(low, 0);
  high = std::min<long double>(high, kRopeDim - 1);
  if (low == high) high += 0.001L;  // avoid a zero-width ramp, as the reference does
  for (int i = 0; i < kRopePairs; ++i) {
    const long double ramp = std::clamp((static_cast<long double>(i) - low) / (high - low), 0.0L, 1.0L);
    f[i] = f[i] / static_cast<long double>(rope.factor) * ramp + f[i] * (1 - ramp);
  }
  return f;
}

long double rope_mscale(const RopeConfig& rope) {
  if (rope.scaling != RopeScaling::kDeepseekYarn) return 1.0L;
  return yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim);
}

void rope_exact(const RopeConfig& rope, int64_t pos, int pair, long double* cos_out, long double* sin_out) {
  PCPKV_CHECK(pair >= 0 && pair < kRopePairs, "rope: pair {} out of range [0, 32)", pair);
  const auto f = rope_inv_freq(rope);
  const long double a = static_cast<long double>(pos) * f[pair];
  const long double m = rope_mscale(rope);
  *cos_out = std::cos(a) * m;
  *sin_out = std::sin(a) * m;
}

RopeTable make_rope_table(const RopeConfig& rope, int64_t num_positions) {
  PCPKV_CHECK(num_positions >= 1, "rope: num_positions = {} must be >= 1", num_positions);
  RopeTable t;
  t.num_positions = num_positions;
  t.cos_sin.resize(static_cast<size_t>(num_positions) * kRopeDim);
  const auto f = rope_inv_freq(rope);
  const long double m = rope_mscale(rope);
  for (int64_t p = 0; p < num_positions; ++p) {
    float* row = t.cos_sin.data() + p * kRopeDim;
    for (int i = 0; i < kRopePairs; ++i) {
      const long double a = static_cast<long double>(p) * f[i];
      row[i] = static_cast<float>(std::cos(a) * m);
      row[kRopePairs + i] = static_cast<float>(std::sin(a) * m);
    }
  }
  return t;
}

}  // namespace pcpkv
