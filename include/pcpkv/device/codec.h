// pcpkv/device/codec.h: number formats of the caches, bit-exact on host and device.
//
//   bf16   <- float: round to nearest even; NaN -> 0x7FFF (canonical, as cvt.rn.bf16.f32).
//   E4M3   <- float: e4m3fn, round to nearest even, finite values and +-inf saturate to +-448
//                    (0x7E/0xFE, as cvt.rn.satfinite.e4m3x2.f32); NaN -> 0x7F.       SPEC section 3.
//   E4M3   -> float: exact.
//   UE8M0  : power-of-two scales with an exact ceil(log2(x)) read from the float's bits.
//
// The host versions are the software oracle. On the device the same functions are used by the
// reference-style code paths; kernels may use the hardware conversions (hw_* below), which the GPU test
// suite checks against these for every float bit pattern.
#pragma once

#include <cstdint>

#include "pcpkv/device/config.h"
#include "pcpkv/device/fp32.h"

namespace pcpkv::codec {

constexpr float kE4M3Max = 448.0f;

// ---- bf16 ---------------------------------------------------------------------------------------
PCPKV_HD uint16_t float_to_bf16(float f) {
  uint32_t u = fp32::bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}
PCPKV_HD float bf16_to_float(uint16_t h) { return fp32::from_bits(static_cast<uint32_t>(h) << 16); }

// ---- E4M3 (e4m3fn: bias 7, no inf, S.1111.111 = NaN, max 448) -------------------------------------
PCPKV_HD uint8_t float_to_e4m3(float f) {
  const uint32_t u = fp32::bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;                      // NaN
  if (a > 0x43e00000u) return static_cast<uint8_t>(sign | 0x7e);  // > 448 (and inf): saturate
  const int exp_f = static_cast<int>(a >> 23);           // biased float exponent
  if (exp_f == 0) return sign;                           // float zero/subnormal: far below 2^-10
  const uint32_t sig = (a & 0x7fffffu) | 0x800000u;      // 24-bit significand
  const int e = exp_f - 127;                             // unbiased
  // Target: normal if e >= -6 (3 mantissa bits), else subnormal in units of 2^-9.
  int shift;
  uint32_t base;
  if (e >= -6) {
    shift = 20;
    base = static_cast<uint32_t>(e + 7) << 3;            // exponent field; sig's hidden bit adds 8 below
  } else {
    shift = 14 - e;                                      // sig * 2^(e-23) / 2^-9 = sig >> (14 - e)
    base = 0;
  }
  if (shift > 31) return sign;                           // < 2^-11 of a unit: rounds to zero
  const uint32_t kept = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  uint32_t q = (e >= -6) ? base + (kept - 8u) : kept;    // drop the hidden bit for normals
  if (rem > half || (rem == half && (q & 1u))) q += 1u;  // carry may bump the exponent: still right
  if (q > 0x7eu) q = 0x7eu;                              // 448 < |f| <= 464 rounds to 448 anyway
  return static_cast<uint8_t>(sign | q);
}

PCPKV_HD float e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu;
  const uint32_t m = b & 0x7u;
  if (e == 0xfu && m == 0x7u) return fp32::from_bits(sign | 0x7fc00000u);  // NaN
  if (e == 0) {
    // subnormal: m * 2^-9, exact in float
    const float v = static_cast<float>(m) * 0.001953125f;
    return sign ? -v : v;
  }
  return fp32::from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

// ---- UE8M0 / power-of-two scales -----------------------------------------------------------------
/// Exact ceil(log2(x)) for a positive, finite, normal float x.
PCPKV_HD int ceil_log2(float x) {
  const uint32_t u = fp32::bits(x);
  const int e = static_cast<int>((u >> 23) & 0xffu) - 127;
  return (u & 0x7fffffu) ? e + 1 : e;
}
/// 2^k as a float, for k in [-126, 127].
PCPKV_HD float exp2i(int k) { return fp32::from_bits(static_cast<uint32_t>(k + 127) << 23); }

/// Indexer-K scale (SPEC section 3): s = 2^ceil(log2(max(amax, 1e-4) / 448)).
PCPKV_HD float indexer_scale(float amax) {
  return exp2i(ceil_log2(fp32::div(fp32::max(amax, 1e-4f), kE4M3Max)));
}

/// fp8_ds_mla tile scale (SPEC section 3).
///   pow2 (default): s = 2^ceil(log2(max(amax / 448, 1e-4)))   (all-zero tile -> 2^-13)
///   raw  (old vLLM): s = max(amax / 448, FLT_MIN)
PCPKV_HD float ds_mla_tile_scale(float amax, bool pow2) {
  const float r = fp32::div(amax, kE4M3Max);
  if (pow2) return exp2i(ceil_log2(fp32::max(r, 1e-4f)));
  return fp32::max(r, 1.17549435e-38f);
}

/// The cache byte of value x under scale s: E4M3(x / s). Division, not multiplication by 1/s.
PCPKV_HD uint8_t quantize_e4m3(float x, float s) { return float_to_e4m3(fp32::div(x, s)); }

}  // namespace pcpkv::codec
