// src/serving/kernels/cuda/router_fp8_quant.cu: FP8 per-token-group quantization (group 128) and its dequantizing
// consumer (pcpkv/serving/router.h). One warp per (token, group), 4 elements per lane; the arithmetic is
// codec.h/fp32.h, so the bytes equal the CPU reference's. Both kernels wait on the grid dependency before touching
// memory (PDL chain b of pcpkv/core/pdl.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/check.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/pdl.h"
#include "pcpkv/serving/router.h"

namespace pcpkv::cuda {
namespace {

constexpr int kWarps = 8;

struct QuantArgs {
  const uint16_t* x;
  int64_t x_stride;
  uint8_t* q;
  void* scales;
  int64_t scale_token_stride;
  int64_t scale_group_stride;
  int64_t num_tokens;
  int64_t hidden;
  uint16_t* y;  // dequant output
  bool ue8m0;
  bool ue8m0_bytes;
};

__device__ __forceinline__ float group_scale(float amax, bool ue8m0) {
  const float a = fp32::max(amax, 1e-4f);
  return ue8m0 ? codec::exp2i(codec::ceil_log2(fp32::div(a, codec::kE4M3Max))) : fp32::div(a, codec::kE4M3Max);
}

__global__ void __launch_bounds__(kWarps * 32) fp8_group_quant_kernel(QuantArgs a) {
  pdl::wait();
  pdl::launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t num_groups = a.hidden / kFp8QuantGroup;
  const int64_t pair = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5);
  if (pair >= a.num_tokens * num_groups) return;
  const int64_t t = pair / num_groups, g = pair % num_groups;
  const uint2 raw = *reinterpret_cast<const uint2*>(a.x + t * a.x_stride + g * kFp8QuantGroup + lane * 4);
  float v[4] = {codec::bf16_to_float(static_cast<uint16_t>(raw.x)), codec::bf16_to_float(static_cast<uint16_t>(raw.x >> 16)),
                codec::bf16_to_float(static_cast<uint16_t>(raw.y)), codec::bf16_to_float(static_cast<uint16_t>(raw.y >> 16))};
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = fp32::amax(amax, fp32::abs(v[i]));
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) amax = fp32::amax(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = group_scale(amax, a.ue8m0);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) packed |= static_cast<uint32_t>(codec::quantize_e4m3(v[i], s)) << (8 * i);
  *reinterpret_cast<uint32_t*>(a.q + t * a.hidden + g * kFp8QuantGroup + lane * 4) = packed;
  if (lane == 0) {
    const int64_t si = t * a.scale_token_stride + g * a.scale_group_stride;
    if (a.ue8m0_bytes)
      static_cast<uint8_t*>(a.scales)[si] = static_cast<uint8_t>(fp32::bits(s) >> 23);
    else
      static_cast<float*>(a.scales)[si] = s;
  }
}

__global__ void __launch_bounds__(kWarps * 32) fp8_group_dequant_kernel(QuantArgs a) {
  pdl::wait();
  pdl::launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t num_groups = a.hidden / kFp8QuantGroup;
  const int64_t pair = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5);
  if (pair >= a.num_tokens * num_groups) return;
  const int64_t t = pair / num_groups, g = pair % num_groups;
  const int64_t si = t * a.scale_token_stride + g * a.scale_group_stride;
  const float s = a.ue8m0_bytes
                      ? fp32::from_bits(static_cast<uint32_t>(static_cast<const uint8_t*>(a.scales)[si]) << 23)
                      : static_cast<const float*>(a.scales)[si];
  const int64_t base = t * a.hidden + g * kFp8QuantGroup + lane * 4;
  const uint32_t packed = *reinterpret_cast<const uint32_t*>(a.q + base);
  uint16_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = codec::float_to_bf16(fp32::mul(codec::e4m3_to_float(static_cast<uint8_t>(packed >> (8 * i))), s));
  *reinterpret_cast<uint2*>(a.y + base) =
      make_uint2(out[0] | (static_cast<uint32_t>(out[1]) << 16), out[2] | (static_cast<uint32_t>(out[3]) << 16));
}

QuantArgs make_args(const Fp8GroupQuantParams& p, uint16_t* y) {
  return QuantArgs{p.x,
                   p.x_stride,
                   p.q,
                   p.scales,
                   fp8_scale_token_stride(p),
                   p.scale_group_stride,
                   p.num_tokens,
                   p.hidden,
                   y,
                   p.format == Fp8ScaleFormat::kUe8m0,
                   p.scales_ue8m0_bytes};
}

unsigned num_blocks(const Fp8GroupQuantParams& p) {
  const int64_t pairs = p.num_tokens * (p.hidden / kFp8QuantGroup);
  return static_cast<unsigned>((pairs + kWarps - 1) / kWarps);
}

void check_alignment(const Fp8GroupQuantParams& p) {
  PCPKV_CHECK((reinterpret_cast<uintptr_t>(p.x) & 7u) == 0, "fp8 quant: x must be 8-byte aligned");
  PCPKV_CHECK((reinterpret_cast<uintptr_t>(p.q) & 3u) == 0, "fp8 quant: q must be 4-byte aligned");
  PCPKV_CHECK(p.scales_ue8m0_bytes || (reinterpret_cast<uintptr_t>(p.scales) & 3u) == 0,
              "fp8 quant: fp32 scales must be 4-byte aligned");
}

}  // namespace

void fp8_group_quant(const Fp8GroupQuantParams& p, CUstream_st* stream, bool pdl) {
  validate_fp8_group_quant(p);
  if (p.num_tokens == 0) return;
  check_alignment(p);
  PCPKV_CUDA_CHECK(
      pdl::launch(fp8_group_quant_kernel, dim3(num_blocks(p)), dim3(kWarps * 32), 0, stream, pdl, make_args(p, nullptr)));
}

void fp8_group_dequant(const Fp8GroupQuantParams& p, uint16_t* y, CUstream_st* stream, bool pdl) {
  validate_fp8_group_quant(p);
  if (p.num_tokens == 0) return;
  check_alignment(p);
  PCPKV_CHECK(y != nullptr && (reinterpret_cast<uintptr_t>(y) & 7u) == 0, "fp8 dequant: y must be non-null and 8-byte aligned");
  PCPKV_CUDA_CHECK(
      pdl::launch(fp8_group_dequant_kernel, dim3(num_blocks(p)), dim3(kWarps * 32), 0, stream, pdl, make_args(p, y)));
}

}  // namespace pcpkv::cuda
