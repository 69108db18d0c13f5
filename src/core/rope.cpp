// RoPE cos/sin tables (SPEC section 1): default and DeepSeek-YaRN inverse frequencies in long double.
#include "pcpkv/rope.h"

#include <algorithm>
#include <cmath>

#include "pcpkv/error.h"

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

}  // namespace

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
