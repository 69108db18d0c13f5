#include "support/random_bf16.h"

#include <algorithm>
#include <cmath>

#include "pcpkv/device/codec.h"

namespace pcpkv::test {
namespace {

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Standard normal by Box-Muller from one hash (test sizes are small; exactness of the tails is irrelevant).
double normal(uint64_t h) {
  const double u1 = (static_cast<double>(h >> 40) + 0.5) / 16777216.0;
  const double u2 = static_cast<double>(h & 0xffffff) / 16777216.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace

uint64_t hash64(uint64_t seed, uint64_t index) { return mix64(mix64(seed + 0x51ed270b27e3ull) + (index + 1) * 0x9e3779b97f4a7c15ull); }

std::vector<uint16_t> random_bf16(int64_t rows, int64_t width, uint64_t seed, int num_outliers, double scale) {
  num_outliers = std::clamp(num_outliers, 0, 4);
  std::vector<int64_t> outlier_channel;
  std::vector<double> outlier_gain;
  for (uint64_t draw = 0; static_cast<int>(outlier_channel.size()) < std::min<int64_t>(num_outliers, width); ++draw) {
    const int64_t c = static_cast<int64_t>(hash64(seed ^ 0x0c7ull, draw) % static_cast<uint64_t>(width));
    if (std::find(outlier_channel.begin(), outlier_channel.end(), c) != outlier_channel.end()) continue;
    outlier_channel.push_back(c);
    outlier_gain.push_back(20.0 + static_cast<double>(hash64(seed ^ 0x9a1ull, draw) % 31));
  }
  std::vector<uint16_t> out(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r) {
    const double row_scale = scale * std::exp(0.5 * normal(hash64(seed ^ 0x707ull, static_cast<uint64_t>(r))));
    for (int64_t c = 0; c < width; ++c) {
      double v = normal(hash64(seed, static_cast<uint64_t>(r * width + c))) * row_scale;
      for (size_t k = 0; k < outlier_channel.size(); ++k)
        if (outlier_channel[k] == c) v *= outlier_gain[k];
      uint16_t b = codec::float_to_bf16(static_cast<float>(v));
      if ((b & 0x7fffu) == 0) b = codec::float_to_bf16(static_cast<float>(row_scale * 1e-2));  // never zero
      out[static_cast<size_t>(r * width + c)] = b;
    }
  }
  return out;
}

std::vector<float> random_weights(int64_t n, uint64_t seed, double mean, double spread) {
  std::vector<float> w(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double v = mean + spread * normal(hash64(seed ^ 0x3e16u, static_cast<uint64_t>(i)));
    if (v == 0.0) v = 1e-2;
    w[static_cast<size_t>(i)] = codec::bf16_to_float(codec::float_to_bf16(static_cast<float>(v)));
  }
  return w;
}

}  // namespace pcpkv::test
