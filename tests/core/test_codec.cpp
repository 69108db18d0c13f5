// pcpkv-test-labels: unit
// Codecs (SPEC section 3) against independent oracles: brute-force nearest-value search for E4M3,
// a long double model for bf16, and exact ceil-log2 by repeated doubling.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/device/codec.h"

namespace pcpkv {
namespace {

float f_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// All 254 non-NaN E4M3 values, decoded independently from the format definition.
double e4m3_value_oracle(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return s ? -mag : mag;
}

// Round-to-nearest-even over the finite E4M3 values with saturation to +-448 (satfinite).
uint8_t e4m3_encode_oracle(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const long double a = std::fabs(static_cast<long double>(x));
  if (a >= 448.0L) return sign | 0x7e;
  uint8_t best = 0;
  long double best_err = a;  // against +0
  for (uint8_t code = 1; code <= 0x7e; ++code) {
    const long double v = e4m3_value_oracle(code);
    const long double err = std::fabs(v - a);
    if (err < best_err || (err == best_err && (code & 1) == 0 && (best & 1) == 1)) {
      best = code;
      best_err = err;
    }
  }
  return sign | best;
}

TEST(Codec, E4M3DecodeMatchesDefinition) {
  for (int b = 0; b < 256; ++b) {
    const float f = codec::e4m3_to_float(static_cast<uint8_t>(b));
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(f), e4m3_value_oracle(static_cast<uint8_t>(b))) << b;
    }
  }
  EXPECT_EQ(codec::e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(codec::e4m3_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(Codec, E4M3EncodeAllBf16Values) {
  // Every bf16 bit pattern as a float input: 65536 cases, including inf and NaN.
  int64_t checked = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float x = f_from_bits(h << 16);
    ASSERT_EQ(codec::float_to_e4m3(x), e4m3_encode_oracle(x)) << "bf16 0x" << std::hex << h << " = " << x;
    ++checked;
  }
  EXPECT_EQ(checked, 65536);
}

TEST(Codec, E4M3EncodeHalfwayAndEdges) {
  std::vector<float> xs;
  // Midpoints between all adjacent positive E4M3 values, and one float ulp either side.
  for (uint8_t c = 0; c < 0x7e; ++c) {
    const double lo = e4m3_value_oracle(c), hi = e4m3_value_oracle(static_cast<uint8_t>(c + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: both have few bits
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    xs.push_back(mid);
    xs.push_back(std::nextafter(mid, 0.0f));
    xs.push_back(std::nextafter(mid, 1e9f));
  }
  // Saturation: 448, the midpoint to the (nonexistent) 480, above it, max float, inf.
  for (float v : {448.0f, 463.99997f, 464.0f, 464.00003f, 479.0f, 480.0f, 1e6f,
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity()})
    xs.push_back(v);
  // Subnormal E4M3 range and below (2^-10 is the midpoint between 0 and the smallest subnormal).
  for (int k = -20; k <= -6; ++k) {
    xs.push_back(std::ldexp(1.0f, k));
    xs.push_back(std::ldexp(1.5f, k));
    xs.push_back(std::nextafter(std::ldexp(1.0f, k), 0.0f));
  }
  xs.push_back(std::numeric_limits<float>::denorm_min());
  xs.push_back(std::numeric_limits<float>::min());
  xs.push_back(0.0f);
  for (float x : std::vector<float>(xs)) xs.push_back(-x);
  for (float x : xs) EXPECT_EQ(codec::float_to_e4m3(x), e4m3_encode_oracle(x)) << x;

  EXPECT_EQ(codec::float_to_e4m3(464.0f), 0x7e);  // tie between 448 and 480: even mantissa is 448
  EXPECT_EQ(codec::float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(codec::float_to_e4m3(std::nanf("")), 0x7f);
  EXPECT_EQ(codec::float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // tie between 0 and 2^-9 -> 0
  EXPECT_EQ(codec::float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);  // tie between 1 and 2 (x 2^-9) -> 2
}

TEST(Codec, E4M3RoundTripsEveryCode) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    const float f = codec::e4m3_to_float(static_cast<uint8_t>(b));
    const uint8_t back = codec::float_to_e4m3(f);
    if (b == 0x80) {
      EXPECT_EQ(back, 0x80);  // -0 keeps its sign
    } else {
      EXPECT_EQ(back, b);
    }
  }
}

TEST(Codec, Bf16RoundToNearestEven) {
  // Every bf16 value, the midpoints to its neighbour, and one float ulp around each midpoint.
  for (uint32_t h = 0; h < 0x7f80; ++h) {  // positive finite
    const uint32_t base = h << 16;
    EXPECT_EQ(codec::float_to_bf16(f_from_bits(base)), h);
    const uint32_t mid = base | 0x8000u;
    const uint16_t even = (h & 1) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h);
    ASSERT_EQ(codec::float_to_bf16(f_from_bits(mid)), even) << std::hex << h;
    ASSERT_EQ(codec::float_to_bf16(f_from_bits(mid - 1)), h);
    ASSERT_EQ(codec::float_to_bf16(f_from_bits(mid + 1)), h + 1);
    ASSERT_EQ(codec::float_to_bf16(f_from_bits(base | 0x80000000u)), h | 0x8000u);
  }
  EXPECT_EQ(codec::float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(codec::float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(codec::float_to_bf16(std::nanf("")), 0x7fff);
  EXPECT_EQ(codec::float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = codec::bf16_to_float(static_cast<uint16_t>(h));
    uint32_t u;
    std::memcpy(&u, &f, 4);
    EXPECT_EQ(u, h << 16);
  }
}

TEST(Codec, CeilLog2IsExact) {
  for (int k = -126; k <= 126; ++k) {
    const float p = std::ldexp(1.0f, k);
    EXPECT_EQ(codec::ceil_log2(p), k);
    EXPECT_EQ(codec::ceil_log2(std::nextafter(p, std::numeric_limits<float>::infinity())), k + 1);
    if (k > -126) {
      EXPECT_EQ(codec::ceil_log2(std::nextafter(p, 0.0f)), k);
    }
    EXPECT_EQ(codec::exp2i(k), p);
  }
}

TEST(Codec, IndexerScaleIsUe8m0) {
  // s = 2^ceil(log2(max(amax, 1e-4) / 448)); check against long double ceil(log2()).
  for (float amax : {0.0f, 1e-9f, 1e-4f, 0.05f, 0.4375f, 0.5f, 1.0f, 3.0f, 448.0f, 449.0f, 896.0f, 1e4f}) {
    const float q = std::max(amax, 1e-4f) / 448.0f;
    const int k = static_cast<int>(std::ceil(std::log2(static_cast<long double>(q))));
    EXPECT_EQ(codec::indexer_scale(amax), std::ldexp(1.0f, k)) << amax;
  }
  EXPECT_EQ(codec::indexer_scale(448.0f), 1.0f);
  EXPECT_EQ(codec::indexer_scale(896.0f), 2.0f);
  EXPECT_EQ(codec::indexer_scale(896.5f), 4.0f);
}

TEST(Codec, DsMlaTileScale) {
  EXPECT_EQ(codec::ds_mla_tile_scale(0.0f, true), std::ldexp(1.0f, -13));  // all-zero tile: 2^-13, never NaN
  EXPECT_EQ(codec::ds_mla_tile_scale(448.0f, true), 1.0f);
  EXPECT_EQ(codec::ds_mla_tile_scale(449.0f, true), 2.0f);
  EXPECT_EQ(codec::ds_mla_tile_scale(0.0f, false), std::numeric_limits<float>::min());
  EXPECT_EQ(codec::ds_mla_tile_scale(10.0f, false), 10.0f / 448.0f);
  // A value at amax quantizes to at most 448 under either rule.
  for (float amax : {0.01f, 0.3f, 1.7f, 13.0f, 448.0f, 5000.0f}) {
    for (bool pow2 : {true, false}) {
      const float s = codec::ds_mla_tile_scale(amax, pow2);
      const uint8_t q = codec::quantize_e4m3(amax, s);
      EXPECT_LE(codec::e4m3_to_float(q), 448.0f);
      EXPECT_NE(q & 0x7f, 0x7f);
    }
  }
}

}  // namespace
}  // namespace pcpkv
