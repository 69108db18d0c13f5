// pcpkv/device/pack.h: per-row encoders of the cache and transport formats (SPEC section 3), host and device.
//
// Scalar, one row at a time: the CPU reference uses them as they are; a CUDA kernel may call them from one
// thread per row (reference-style kernels) or reproduce them lane-parallel. Every conversion goes through
// codec.h, so the bytes are those of the SPEC:
//   bf16 row       : kv_c 512 bf16 | k_pe 64 bf16                                    (1152 B)
//   fp8 row        : kv_c 512 e4m3 | k_pe 64 e4m3, both x / k_scale                  ( 576 B)
//   fp8_ds_mla row : kv_c 4 tiles x 128 e4m3 (x / s_k) | 4 fp32 s_k | k_pe 64 bf16   ( 656 B)
//   indexer slot   : 128 e4m3 (x / s) and one fp32 UE8M0 scale s (stored apart)      ( 132 B)
// Multi-byte values are stored little-endian byte by byte, so no alignment is assumed.
#pragma once

#include <cstdint>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/config.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/core/layout.h"

namespace pcpkv::pack {

PCPKV_HD void store_u16_le(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xffu);
  p[1] = static_cast<uint8_t>(v >> 8);
}
PCPKV_HD void store_f32_le(uint8_t* p, float f) {
  const uint32_t u = fp32::bits(f);
  p[0] = static_cast<uint8_t>(u & 0xffu);
  p[1] = static_cast<uint8_t>((u >> 8) & 0xffu);
  p[2] = static_cast<uint8_t>((u >> 16) & 0xffu);
  p[3] = static_cast<uint8_t>(u >> 24);
}
PCPKV_HD uint16_t load_u16_le(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}
PCPKV_HD float load_f32_le(const uint8_t* p) {
  return fp32::from_bits(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24));
}

/// max |x[i]| over n values; NaN lanes are skipped (fp32::amax), so the result does not depend on order.
PCPKV_HD float amax_abs(const float* x, int n) {
  float a = 0.0f;
  for (int i = 0; i < n; ++i) a = fp32::amax(a, fp32::abs(x[i]));
  return a;
}

/// MLA cache row of one token (SPEC section 3) from fp32 kv_c[512] and k_pe[64] into row[0, mla_row_bytes).
PCPKV_HD void encode_mla_row(const float* kv_c, const float* k_pe, const CacheFormat& fmt, uint8_t* row) {
  if (fmt.kv_format == KvFormat::kBf16) {
    for (int i = 0; i < 512; ++i) store_u16_le(row + 2 * i, codec::float_to_bf16(kv_c[i]));
    for (int i = 0; i < 64; ++i) store_u16_le(row + 1024 + 2 * i, codec::float_to_bf16(k_pe[i]));
  } else if (fmt.kv_format == KvFormat::kFp8) {
    for (int i = 0; i < 512; ++i) row[i] = codec::quantize_e4m3(kv_c[i], fmt.k_scale);
    for (int i = 0; i < 64; ++i) row[512 + i] = codec::quantize_e4m3(k_pe[i], fmt.k_scale);
  } else {  // fp8_ds_mla
    const bool pow2 = fmt.ds_mla_scale == DsMlaScale::kPow2;
    for (int tile = 0; tile < 4; ++tile) {
      const float* x = kv_c + tile * kDsMlaTile;
      const float s = codec::ds_mla_tile_scale(amax_abs(x, kDsMlaTile), pow2);
      uint8_t* q = row + kDsMlaKvcOffset + tile * kDsMlaTile;
      for (int i = 0; i < kDsMlaTile; ++i) q[i] = codec::quantize_e4m3(x[i], s);
      store_f32_le(row + kDsMlaScaleOffset + 4 * tile, s);
    }
    for (int i = 0; i < 64; ++i) store_u16_le(row + kDsMlaKpeOffset + 2 * i, codec::float_to_bf16(k_pe[i]));
  }
}

/// Indexer-K slot of one token (SPEC section 3) from fp32 k[128]: data[0, 128) e4m3, scale_out[0, 4) fp32.
PCPKV_HD void encode_index_k(const float* k, uint8_t* data, uint8_t* scale_out) {
  const float s = codec::indexer_scale(amax_abs(k, 128));
  for (int i = 0; i < 128; ++i) data[i] = codec::quantize_e4m3(k[i], s);
  store_f32_le(scale_out, s);
}

}  // namespace pcpkv::pack
