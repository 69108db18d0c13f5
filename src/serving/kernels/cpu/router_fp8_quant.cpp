// src/serving/kernels/cpu/router_fp8_quant.cpp: CPU reference of FP8 per-token-group quantization
// (pcpkv/serving/router.h) and of its dequantizing consumer. Same helpers (codec.h, fp32.h) as the CUDA kernels:
// bit-exact.
#include <cstdint>
#include <cstring>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/core/error.h"
#include "pcpkv/serving/router.h"

namespace pcpkv {

void validate_fp8_group_quant(const Fp8GroupQuantParams& p) {
  PCPKV_CHECK(p.num_tokens >= 0, "fp8 quant: num_tokens = {} must be >= 0", p.num_tokens);
  PCPKV_CHECK(p.hidden > 0 && p.hidden % kFp8QuantGroup == 0,
              "fp8 quant: hidden = {} must be a positive multiple of {}", p.hidden, kFp8QuantGroup);
  PCPKV_CHECK(p.x_stride >= p.hidden && p.x_stride % 8 == 0,
              "fp8 quant: x_stride = {} must be >= hidden = {} and a multiple of 8", p.x_stride, p.hidden);
  PCPKV_CHECK(p.scale_token_stride >= 0 && p.scale_group_stride >= 0,
              "fp8 quant: scale strides ({}, {}) must be >= 0", p.scale_token_stride, p.scale_group_stride);
  PCPKV_CHECK(p.hidden <= kFp8QuantGroup || p.scale_group_stride > 0,
              "fp8 quant: scale_group_stride = 0 with {} groups makes scales overlap", p.hidden / kFp8QuantGroup);
  PCPKV_CHECK(!p.scales_ue8m0_bytes || p.format == Fp8ScaleFormat::kUe8m0,
              "fp8 quant: scales_ue8m0_bytes needs format ue8m0");
  if (p.num_tokens > 0)
    PCPKV_CHECK(p.x != nullptr && p.q != nullptr && p.scales != nullptr, "fp8 quant: null x, q or scales pointer");
}

namespace {
float group_scale(float amax, Fp8ScaleFormat f) {
  const float a = fp32::max(amax, 1e-4f);
  return f == Fp8ScaleFormat::kUe8m0 ? codec::exp2i(codec::ceil_log2(fp32::div(a, codec::kE4M3Max)))
                                     : fp32::div(a, codec::kE4M3Max);
}
}  // namespace

void fp8_group_quant_reference(const Fp8GroupQuantParams& p) {
  validate_fp8_group_quant(p);
  const int64_t num_groups = p.hidden / kFp8QuantGroup;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const uint16_t* xg = p.x + t * p.x_stride + g * kFp8QuantGroup;
      float amax = 0.0f;
      for (int64_t k = 0; k < kFp8QuantGroup; ++k) amax = fp32::amax(amax, fp32::abs(codec::bf16_to_float(xg[k])));
      const float s = group_scale(amax, p.format);
      uint8_t* qg = p.q + t * p.hidden + g * kFp8QuantGroup;
      for (int64_t k = 0; k < kFp8QuantGroup; ++k) qg[k] = codec::quantize_e4m3(codec::bf16_to_float(xg[k]), s);
      const int64_t si = t * fp8_scale_token_stride(p) + g * p.scale_group_stride;
      if (p.scales_ue8m0_bytes)
        static_cast<uint8_t*>(p.scales)[si] = static_cast<uint8_t>(fp32::bits(s) >> 23);
      else
        static_cast<float*>(p.scales)[si] = s;
    }
  }
}

void fp8_group_dequant_reference(const Fp8GroupQuantParams& p, uint16_t* y) {
  validate_fp8_group_quant(p);
  PCPKV_CHECK(p.num_tokens == 0 || y != nullptr, "fp8 dequant: null y pointer");
  const int64_t num_groups = p.hidden / kFp8QuantGroup;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t si = t * fp8_scale_token_stride(p) + g * p.scale_group_stride;
      const float s = p.scales_ue8m0_bytes
                          ? fp32::from_bits(static_cast<uint32_t>(static_cast<const uint8_t*>(p.scales)[si]) << 23)
                          : static_cast<const float*>(p.scales)[si];
      for (int64_t k = 0; k < kFp8QuantGroup; ++k) {
        const int64_t i = t * p.hidden + g * kFp8QuantGroup + k;
        y[i] = codec::float_to_bf16(fp32::mul(codec::e4m3_to_float(p.q[i]), s));
      }
    }
  }
}

}  // namespace pcpkv
