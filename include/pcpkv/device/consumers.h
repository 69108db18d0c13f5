// pcpkv/device/consumers.h: host+device helpers of the cache consumers (SPEC section 6) that the CPU
// reference and the CUDA kernels share, so both produce the same bits where the contract asks for it.
//
// Indexer score, fixed rounding (CPU and GPU bit-identical). A head's logit q_fp8[h] . k_fp8 has one of
// two definitions (IndexerParams::logit, pcpkv/consumers/indexer.h):
//   kExact (default): the exact dot product, rounded once to fp32 (round to nearest even), -0 -> +0.
//              Every E4M3 value is an integer multiple of 2^-9 below 2^9, so each product is a multiple of
//              2^-18 below 2^18 and any partial sum of the 128 products a multiple of 2^-18 below 2^25:
//              43 bits, exact in fp64 in ANY order. The CPU sums in fp64 sequentially, the GPU on fp64
//              tensor cores (DMMA); both then round the same exact value once.
//   kFp32Tree: fp32 in token_math.h's canonical order: each product of two E4M3 values is exact in fp32
//              (<= 8 significant bits), so fma(q, k, s) == s + q*k; 16 leaves of 8 dims summed
//              sequentially from 0, then the pairwise tree over the 16 leaves.
//   w[h]     = (weights[h] * c) * q_scale[h],  c = fp32(1 / sqrt(128 * H))   (q_scale a power of two)
//   acc      = sum over h = 0, 1, ..., H-1 (sequential, from +0) of relu(logit[h]) * w[h]
//              relu(x) = x < 0 ? 0 : x (NaN stays NaN)
//   score    = canonical_nan(acc * k_scale)                         (k_scale: the slot's UE8M0 scale)
// canonical_nan: every NaN score is stored as 0x7fffffff (what the GPU produces; x86 would propagate the
// input NaN's payload instead, e.g. 0x7fc00000 from a NaN weight).
// Top-k order: scores are compared through order_key() (NaN lowest, -0 == +0); ties go to the lower key
// position. sort_key() packs both into one unique 64-bit key; larger = selected first.
//
// MLA row decode: the cache value of element i of a row, as fp32, exactly as codec.h defines it
// (bf16 -> float; fp8: e4m3 * k_scale; fp8_ds_mla: e4m3 * tile scale, k_pe bf16). The tile scale is read
// through ds_mla_read_scale (stored fp32, or rounded to bf16 the way FlashMLA's SM90 reader uses it).
#pragma once

#include <cstdint>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/config.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/core/layout.h"

// "#pragma unroll" only where nvcc reads it (g++ warns on unknown pragmas).
#if defined(__CUDACC__)
#define PCPKV_CONSUMERS_UNROLL _Pragma("unroll")
#else
#define PCPKV_CONSUMERS_UNROLL
#endif

namespace pcpkv::consumers {

constexpr int kIndexDim = 128;   // index head dim (layout.h kIndexHeadDim)
constexpr int kIndexLeaves = kIndexDim / 8;
constexpr int kMlaQkDim = 576;   // nope 512 | pe 64
constexpr int kMlaVDim = 512;

/// relu that keeps NaN (torch semantics) and is the same on host and device.
PCPKV_HD float relu(float x) { return x < 0.0f ? 0.0f : x; }

/// One head's indexer logit, kFp32Tree definition: q . k over 128 E4M3 values given as floats, in the
/// canonical fp32 order.
PCPKV_HD float index_logit_tree(const float* q, const float* k) {
  float leaf[kIndexLeaves];
PCPKV_CONSUMERS_UNROLL
  for (int j = 0; j < kIndexLeaves; ++j) {
    float s = 0.0f;
PCPKV_CONSUMERS_UNROLL
    for (int e = 0; e < 8; ++e) s = fp32::fma(q[8 * j + e], k[8 * j + e], s);
    leaf[j] = s;
  }
PCPKV_CONSUMERS_UNROLL
  for (int h = 1; h < kIndexLeaves; h <<= 1)
PCPKV_CONSUMERS_UNROLL
    for (int i = 0; i + h < kIndexLeaves; i += 2 * h) leaf[i] = fp32::add(leaf[i], leaf[i + h]);
  return leaf[0];
}

/// kExact definition, last step: the exact dot product (a double that holds it exactly) rounded once to
/// fp32; an exact zero becomes +0 whatever sign the fp64 sum gave it.
PCPKV_HD float index_logit_from_exact(double exact) {
#if PCPKV_ON_DEVICE
  const float f = __double2float_rn(exact);
#else
  const float f = static_cast<float>(exact);  // round to nearest even (the default FP environment)
#endif
  return f == 0.0f ? 0.0f : f;
}

/// kExact definition: q . k over 128 E4M3 values given as floats, summed exactly in fp64 (see the header
/// comment: no order dependence), then rounded once.
PCPKV_HD float index_logit_exact(const float* q, const float* k) {
  double s = 0.0;
  for (int d = 0; d < kIndexDim; ++d) s += static_cast<double>(q[d]) * static_cast<double>(k[d]);
  return index_logit_from_exact(s);
}

/// Every NaN -> the one quiet NaN 0x7fffffff (the score output's canonical NaN); other values unchanged.
PCPKV_HD float canonical_nan(float x) { return x != x ? fp32::from_bits(0x7fffffffu) : x; }

/// One key's score from its per-head terms (relu(logit[h]) * w[h], h ascending) and its k_scale.
/// term(h) is called for h = 0..H-1 in order.
template <class Term>
PCPKV_HD float index_score(int num_heads, float k_scale, Term&& term) {
  float acc = 0.0f;
  for (int h = 0; h < num_heads; ++h) acc = fp32::add(acc, term(h));
  return canonical_nan(fp32::mul(acc, k_scale));
}

/// One head's term of the score sum: relu(logit) * w.
PCPKV_HD float index_term(float logit, float w) { return fp32::mul(relu(logit), w); }

/// Folded head weight w[h] = (weights[h] * c) * q_scale[h]; c = index_weight_scale(H).
PCPKV_HD float index_head_weight(float weight, float c, float q_scale) {
  return fp32::mul(fp32::mul(weight, c), q_scale);
}

/// Orderable 32-bit key of a score: larger key = larger score; every NaN maps to 0 (below -inf);
/// -0 and +0 map to the same key.
PCPKV_HD uint32_t order_key(float score) {
  uint32_t u = fp32::bits(score);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN
  if (u == 0x80000000u) u = 0u;                     // -0 -> +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// Unique selection key of (score, key position): larger = earlier in the top-k; equal scores rank the
/// lower position first. position < 2^31.
PCPKV_HD uint64_t sort_key(float score, int64_t position) {
  return (static_cast<uint64_t>(order_key(score)) << 32) |
         static_cast<uint64_t>(0xffffffffu - static_cast<uint32_t>(position));
}
PCPKV_HD int64_t sort_key_position(uint64_t key) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(key & 0xffffffffu));
}

// ---- MLA cache rows ----------------------------------------------------------------------------

/// An fp8_ds_mla tile scale as the attention reads it (SparseMlaParams::scales_as_bf16): the stored fp32
/// (default), or rounded to bf16 (round to nearest even), as FlashMLA's SM90 reader converts it before use.
/// pow2 scales are bf16-exact, so both reads agree on them; raw scales move by up to 2^-8 relative.
PCPKV_HD float ds_mla_read_scale(uint32_t bits, bool as_bf16) {
  const float s = fp32::from_bits(bits);
  return as_bf16 ? codec::bf16_to_float(codec::float_to_bf16(s)) : s;
}

/// Cache value of elements [8*chunk, 8*chunk + 8) of one MLA row (chunk 0..71: 64 chunks of kv_c, then
/// 8 of k_pe), as fp32. row: first byte of the row. k_scale: static fp8 scale (ignored otherwise).
/// scales_as_bf16: fp8_ds_mla tile scales read through bf16 (ds_mla_read_scale).
PCPKV_HD void mla_decode_chunk(const uint8_t* row, KvFormat fmt, float k_scale, int chunk, float* out,
                               bool scales_as_bf16 = false) {
  const int base = 8 * chunk;
  if (fmt == KvFormat::kBf16) {
PCPKV_CONSUMERS_UNROLL
    for (int e = 0; e < 8; ++e) {
      const uint8_t* p = row + 2 * (base + e);
      out[e] = codec::bf16_to_float(static_cast<uint16_t>(p[0] | (p[1] << 8)));
    }
  } else if (fmt == KvFormat::kFp8) {
PCPKV_CONSUMERS_UNROLL
    for (int e = 0; e < 8; ++e) out[e] = fp32::mul(codec::e4m3_to_float(row[base + e]), k_scale);
  } else {
    if (base < 512) {
      const uint8_t* sp = row + kDsMlaScaleOffset + 4 * (base / 128);
      const uint32_t sb = static_cast<uint32_t>(sp[0]) | (static_cast<uint32_t>(sp[1]) << 8) |
                          (static_cast<uint32_t>(sp[2]) << 16) | (static_cast<uint32_t>(sp[3]) << 24);
      const float s = ds_mla_read_scale(sb, scales_as_bf16);
PCPKV_CONSUMERS_UNROLL
      for (int e = 0; e < 8; ++e) out[e] = fp32::mul(codec::e4m3_to_float(row[base + e]), s);
    } else {
PCPKV_CONSUMERS_UNROLL
      for (int e = 0; e < 8; ++e) {
        const uint8_t* p = row + kDsMlaKpeOffset + 2 * (base - 512 + e);
        out[e] = codec::bf16_to_float(static_cast<uint16_t>(p[0] | (p[1] << 8)));
      }
    }
  }
}

}  // namespace pcpkv::consumers
