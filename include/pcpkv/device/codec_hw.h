// pcpkv/device/codec_hw.h: the hardware conversions of sm_89+ (cvt.rn.satfinite.e4m3x2.f32,
// cvt.rn.bf16x2.f32) behind the same names on host and device.
//
// On the host, and on devices older than sm_89, every function falls back to the software oracle of
// codec.h, so the results are defined everywhere. tests/core/test_codec_exhaustive.cu checks on the GPU
// that the hardware results equal codec.h for every one of the 2^32 float bit patterns (both lanes of each
// x2 instruction); kernels may use these only because that test passes. PCPKV_SOFTWARE_CODEC=1 (a compile
// definition) forces the software path on the device too.
//
// Packing: "lo" lands in the low byte / half of the result, "hi" in the high one (little-endian memory
// order: lo is stored first).
#pragma once

#include <cstdint>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/config.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890) && !defined(PCPKV_SOFTWARE_CODEC)
#define PCPKV_HW_CODEC 1
#else
#define PCPKV_HW_CODEC 0
#endif

namespace pcpkv::codec {

/// Two floats -> two E4M3 bytes (lo in bits 0..7). Same bytes as float_to_e4m3 on each.
PCPKV_HD uint16_t hw_float2_to_e4m3x2(float lo, float hi) {
#if PCPKV_HW_CODEC
  uint16_t r;
  // PTX: d = {cvt(a) in the upper byte, cvt(b) in the lower byte}.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return static_cast<uint16_t>(float_to_e4m3(lo) | (static_cast<uint16_t>(float_to_e4m3(hi)) << 8));
#endif
}

/// One float -> one E4M3 byte.
PCPKV_HD uint8_t hw_float_to_e4m3(float f) { return static_cast<uint8_t>(hw_float2_to_e4m3x2(f, 0.0f) & 0xffu); }

/// Two floats -> two bf16 (lo in bits 0..15). Same bits as float_to_bf16 on each.
PCPKV_HD uint32_t hw_float2_to_bf16x2(float lo, float hi) {
#if PCPKV_HW_CODEC
  uint32_t r;
  // PTX: d = {cvt(a) in the upper half, cvt(b) in the lower half}.
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return static_cast<uint32_t>(float_to_bf16(lo)) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
#endif
}

/// One float -> bf16.
PCPKV_HD uint16_t hw_float_to_bf16(float f) { return static_cast<uint16_t>(hw_float2_to_bf16x2(f, 0.0f) & 0xffffu); }

/// Four floats -> four E4M3 bytes packed little-endian into one word (x[0] in bits 0..7).
PCPKV_HD uint32_t hw_float4_to_e4m3x4(float x0, float x1, float x2, float x3) {
  return static_cast<uint32_t>(hw_float2_to_e4m3x2(x0, x1)) |
         (static_cast<uint32_t>(hw_float2_to_e4m3x2(x2, x3)) << 16);
}

}  // namespace pcpkv::codec
