// src/publish/kernels/cuda/kernel_util.cuh: small device helpers shared by the pcpkv kernels: vector loads/stores that
// honour a run-time alignment, bf16 unpacking, and the canonical warp reductions of token_math.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/codec_hw.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/device/token_math.h"

namespace pcpkv::cuda {

/// Largest power of two (<= 16) dividing every value: the widest access all of them allow.
__host__ __device__ inline int align_of(uint64_t v) {
  if (v == 0) return 16;
  const uint64_t low = v & (~v + 1);
  return low >= 16 ? 16 : static_cast<int>(low);
}

// ---- loads ----------------------------------------------------------------------------------------
/// 16 bytes from a read-only input (the kernel never writes it). align: 16, 8, 4 or 2 (uniform).
__device__ __forceinline__ uint4 load16_ro(const void* p, int align) {
  if (align >= 16) return __ldg(static_cast<const uint4*>(p));
  uint4 r;
  uint32_t* w = reinterpret_cast<uint32_t*>(&r);
  if (align >= 8) {
    const uint2 a = __ldg(static_cast<const uint2*>(p));
    const uint2 b = __ldg(static_cast<const uint2*>(p) + 1);
    w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y;
  } else if (align >= 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __ldg(static_cast<const uint32_t*>(p) + i);
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = static_cast<uint32_t>(__ldg(h + 2 * i)) | (static_cast<uint32_t>(__ldg(h + 2 * i + 1)) << 16);
  }
  return r;
}

// ---- stores ---------------------------------------------------------------------------------------
/// Stores n = 4, 8 or 16 bytes (words w[0..n/4)) at p whose alignment is at least `align` (1..16).
template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* p, const uint32_t* w, int align) {
  static_assert(N == 4 || N == 8 || N == 16, "store_bytes: 4, 8 or 16 bytes");
  if (align >= N) {
    if constexpr (N == 16) *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    else if constexpr (N == 8) *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    else *reinterpret_cast<uint32_t*>(p) = w[0];
  } else if (align >= 8) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) reinterpret_cast<uint2*>(p)[i] = make_uint2(w[2 * i], w[2 * i + 1]);
  } else if (align >= 4) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) reinterpret_cast<uint32_t*>(p)[i] = w[i];
  } else if (align >= 2) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      reinterpret_cast<uint16_t*>(p)[2 * i] = static_cast<uint16_t>(w[i] & 0xffffu);
      reinterpret_cast<uint16_t*>(p)[2 * i + 1] = static_cast<uint16_t>(w[i] >> 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
  }
}

/// Explicit global vector stores (st.global.v4 / v2 / b32; .cs = evict-first streaming). The compiler
/// splits some plain uint4 stores through reinterpreted byte pointers into four 32-bit stores, and stores
/// through pointers read from shared memory become generic ST; these always assemble to one STG of the
/// given width. p must address global memory (device, peer or host-mapped) aligned to the width.
__device__ __forceinline__ void stg16(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void stg16_cs(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void stg8(void* p, uint32_t a, uint32_t b) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ void stg4(void* p, uint32_t a) {
  asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(a) : "memory");
}

// ---- bf16 ------------------------------------------------------------------------------------------
/// 8 bf16 (one 16-byte vector) -> 8 floats (exact).
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&x)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
/// 8 floats -> 8 bf16 (RNE, codec.h semantics) as 4 words.
__device__ __forceinline__ void pack_bf16x8(const float (&x)[8], uint32_t (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = codec::hw_float2_to_bf16x2(x[2 * i], x[2 * i + 1]);
}
/// 8 floats -> 8 E4M3 bytes (already divided by their scale) as 2 words.
__device__ __forceinline__ void pack_e4m3x8(const float (&x)[8], uint32_t (&w)[2]) {
  w[0] = codec::hw_float4_to_e4m3x4(x[0], x[1], x[2], x[3]);
  w[1] = codec::hw_float4_to_e4m3x4(x[4], x[5], x[6], x[7]);
}

// ---- quantization ------------------------------------------------------------------------------------
/// x / s for every value, one correctly rounded result each. When s is a power of two whose reciprocal is a
/// normal float, x * (1/s) is the same correctly rounded value of the same exact quotient (the reciprocal
/// is exact), so the multiply is used; otherwise a true IEEE division (SPEC section 3: divide, never
/// multiply by an inexact reciprocal).
__device__ __forceinline__ void divide_by_scale(float (&x)[8], float s) {
  const uint32_t b = __float_as_uint(s);
  const uint32_t e = (b >> 23) & 0xffu;
  if ((b & 0x807fffffu) == 0u && e >= 1u && e <= 253u) {
    const float inv = __uint_as_float((254u - e) << 23);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = fp32::mul(x[k], inv);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = fp32::div(x[k], s);
  }
}

/// max |x[k]| over the 8 values, NaN lanes skipped (pack.h's amax_abs, order-independent).
__device__ __forceinline__ float amax8(const float (&x)[8]) {
  float a = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) a = fp32::amax(a, fp32::abs(x[k]));
  return a;
}

// ---- canonical reductions (token_math.h) --------------------------------------------------------------
/// Butterfly sum over `width` lanes (a power of two <= 32) with shfl_xor offsets 1, 2, 4, ...: reproduces the
/// pairwise tree over the lanes' leaves (fp32 addition is commutative, so both partners get the same sum).
template <int kWidth>
__device__ __forceinline__ float lanes_sum(float v, unsigned mask) {
#pragma unroll
  for (int o = 1; o < kWidth; o <<= 1) v = fp32::add(v, __shfl_xor_sync(mask, v, o));
  return v;
}
/// Butterfly max (order-independent; inputs are never NaN since amax skips NaN).
template <int kWidth>
__device__ __forceinline__ float lanes_max(float v, unsigned mask) {
#pragma unroll
  for (int o = 1; o < kWidth; o <<= 1) v = fp32::amax(v, __shfl_xor_sync(mask, v, o));
  return v;
}

}  // namespace pcpkv::cuda
