// pcpkv/device/fp32.h: fp32 arithmetic with one rounding per operation, identical on host and device.
//
// Why: the CPU reference and the CUDA kernels must produce the same bytes. nvcc contracts a*b+c into an
// FMA unless told otherwise, and rsqrtf/fast division are not correctly rounded. Every exactness-critical
// operation in pcpkv goes through these helpers: on the device they are the _rn intrinsics (never
// contracted), on the host plain IEEE operations (the project builds with -ffp-contract=off).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "pcpkv/device/config.h"

namespace pcpkv::fp32 {

PCPKV_HD float add(float a, float b) {
#if PCPKV_ON_DEVICE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
PCPKV_HD float sub(float a, float b) {
#if PCPKV_ON_DEVICE
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
PCPKV_HD float mul(float a, float b) {
#if PCPKV_ON_DEVICE
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
PCPKV_HD float div(float a, float b) {
#if PCPKV_ON_DEVICE
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
/// Fused a*b+c with a single rounding (IEEE fma).
PCPKV_HD float fma(float a, float b, float c) {
#if PCPKV_ON_DEVICE
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
PCPKV_HD float sqrt(float a) {
#if PCPKV_ON_DEVICE
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
/// 1/sqrt(a) as two correctly rounded operations (not rsqrtf, which is approximate on the GPU).
PCPKV_HD float rsqrt(float a) { return div(1.0f, sqrt(a)); }

PCPKV_HD uint32_t bits(float f) {
#if PCPKV_ON_DEVICE
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
PCPKV_HD float from_bits(uint32_t u) {
#if PCPKV_ON_DEVICE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/// max(a, b); when a is NaN the result is b.
PCPKV_HD float max(float a, float b) { return a > b ? a : b; }
/// |a| by clearing the sign bit (NaN stays NaN).
PCPKV_HD float abs(float a) { return from_bits(bits(a) & 0x7fffffffu); }
/// max that ignores a NaN in b (so amax over a vector skips NaN lanes identically everywhere).
PCPKV_HD float amax(float acc, float v) { return v > acc ? v : acc; }

}  // namespace pcpkv::fp32
