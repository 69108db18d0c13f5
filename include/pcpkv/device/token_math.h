// pcpkv/device/token_math.h: the per-token math of the dispatch (SPEC section 2), with one fixed
// rounding order shared by the CPU reference and the CUDA kernels, so both produce the same bytes.
//
// Canonical reduction order (sum or sum of squares over n elements, n a multiple of 8):
//   1. leaves: element chunks [8j, 8j+8) (one 16-byte bf16 vector each), summed sequentially in fp32
//      from s = 0: s = fma(x, x, s) for squares, s = s + x for plain sums;
//   2. the leaves are combined by a recursive pairwise sum over leaf indices, the leaf count padded with
//      zeros to a power of two: sum(p[0..m)) = sum(p[0..m/2)) + sum(p[m/2..m)).
// A GPU reduction where thread t holds leaf t (or leaves [kt, kt+k) for a power-of-two k) and warps
// combine with shfl_xor at offsets 1, 2, 4, ... and then across warps in the same pairwise way reproduces
// this order exactly (fp32 addition is commutative, so both partners of a butterfly hold the same sum).
//
// RMSNorm:   r = 1 / sqrt(sumsq / n + eps);  y = (x * r) * w            (SPEC 2.1, 2.2)
// LayerNorm: mu = sum / n;  d = x - mu;  v = sumsq(d) / n;  r = 1 / sqrt(v + eps);  y = (d * r) * w + b
// RoPE pair: (x0, x1) -> (x0*c - x1*s, x1*c + x0*s), each product rounded, then the sum (no FMA).
//
// Overflow guard (SPEC 2.1, 2.2, 2.4): finite bf16 inputs reach 2^128, and the fp32 sum of squares
// overflows once sum x^2 >= 2^128 (one |x| >= 2^64, or all of 512 elements >= 2^59.5), the LayerNorm sum
// from |x| ~ 2^121. Such a row was published as zeros (r = 1/sqrt(inf) = 0). Both norms are scale invariant: normalizing x * 2^-72 with eps * 2^-144 is the same
// formula, and multiplying by a power of two is exact (except for results below 2^-126, far under the row's
// output resolution). The rescaled row's sums cannot overflow: 4096 * (2^128 * 2^-72)^2 = 2^124 (LayerNorm:
// |x - mu| <= 2^57, 128 * 2^114 = 2^121). So: a row whose ordinary reduction is not finite is recomputed
// from x * kRescale, and that result replaces the ordinary one when it is finite (use_rescaled). Every row
// with a finite reduction, and every row with a NaN / inf input (whose rescaled reduction is not finite
// either), keeps the ordinary path and its bytes; the CPU reference and the kernels take the same branch
// on the same bits.
#pragma once

#include <cstdint>

#include "pcpkv/device/config.h"
#include "pcpkv/device/fp32.h"

namespace pcpkv::math {

constexpr int kLeaf = 8;  // elements per reduction leaf

PCPKV_HD float leaf_sumsq(const float* x) {
  float s = 0.0f;
PCPKV_UNROLL
  for (int k = 0; k < kLeaf; ++k) s = fp32::fma(x[k], x[k], s);
  return s;
}
PCPKV_HD float leaf_sum(const float* x) {
  float s = 0.0f;
PCPKV_UNROLL
  for (int k = 0; k < kLeaf; ++k) s = fp32::add(s, x[k]);
  return s;
}

/// Pairwise sum of p[0..m) in place (m <= 1024), leaf count padded with zeros to a power of two.
/// Host/reference form of the canonical order; kernels reproduce it with warp shuffles.
PCPKV_HD float pairwise_sum(float* p, int m) {
  int width = 1;
  while (width < m) width <<= 1;
  for (int i = m; i < width; ++i) p[i] = 0.0f;  // caller provides room for width elements
  for (int h = 1; h < width; h <<= 1)
    for (int i = 0; i + h < width; i += 2 * h) p[i] = fp32::add(p[i], p[i + h]);
  return p[0];
}

PCPKV_HD float rms_inv(float sumsq, int n, float eps) {
  return fp32::rsqrt(fp32::add(fp32::div(sumsq, static_cast<float>(n)), eps));
}
PCPKV_HD float rms_apply(float x, float r, float w) { return fp32::mul(fp32::mul(x, r), w); }

/// The overflow guard's scale (see the header comment): rows are rescaled by 2^-72, eps by 2^-144.
constexpr float kRescale = 0x1p-72f;

/// False for inf and NaN (as std::isfinite, identically on host and device).
PCPKV_HD bool finite(float v) { return fp32::abs(v) <= 3.40282346638528859812e+38f; }
/// Whether the rescaled reduction replaces the ordinary one: the ordinary one overflowed (or met a NaN /
/// inf input) and the rescaled one is finite (so the input was finite).
PCPKV_HD bool use_rescaled(float ordinary, float rescaled) { return !finite(ordinary) && finite(rescaled); }
/// eps of the rescaled row: eps * 2^-144 in two exact steps (2^-144 itself is subnormal).
PCPKV_HD float rescaled_eps(float eps) { return fp32::mul(fp32::mul(eps, kRescale), kRescale); }
/// leaf_sumsq of the rescaled leaf x * kRescale without writing it (the same bits; no second array live).
PCPKV_HD float leaf_sumsq_rescaled(const float* x) {
  float s = 0.0f;
PCPKV_UNROLL
  for (int k = 0; k < kLeaf; ++k) {
    const float v = fp32::mul(x[k], kRescale);
    s = fp32::fma(v, v, s);
  }
  return s;
}
/// x[0..8) *= kRescale.
PCPKV_HD void rescale_leaf(float* x) {
PCPKV_UNROLL
  for (int k = 0; k < kLeaf; ++k) x[k] = fp32::mul(x[k], kRescale);
}

PCPKV_HD float mean_of(float sum, int n) { return fp32::div(sum, static_cast<float>(n)); }
PCPKV_HD float ln_apply(float d, float r, float w, float b) {
  return fp32::add(fp32::mul(fp32::mul(d, r), w), b);
}

/// Rotates one pair (x0, x1) by the angle with cosine c and sine s.
PCPKV_HD void rope_pair(float& x0, float& x1, float c, float s) {
  const float r0 = fp32::sub(fp32::mul(x0, c), fp32::mul(x1, s));
  const float r1 = fp32::add(fp32::mul(x1, c), fp32::mul(x0, s));
  x0 = r0;
  x1 = r1;
}

/// RoPE over 64 rotary dims in place. cos_sin: [cos 32 | sin 32] for this position (SPEC section 1).
/// interleaved: pairs (2i, 2i+1) use angle i.  NeoX: pairs (i, i+32) use angle i.
PCPKV_HD void rope64(float* x, const float* cos_sin, bool interleaved) {
  for (int i = 0; i < 32; ++i) {
    if (interleaved)
      rope_pair(x[2 * i], x[2 * i + 1], cos_sin[i], cos_sin[32 + i]);
    else
      rope_pair(x[i], x[i + 32], cos_sin[i], cos_sin[32 + i]);
  }
}

constexpr float kHadamard128Scale = 0.08838834764831845f;  // 128^-0.5

/// Optional 128-point Walsh-Hadamard transform of the indexer key (DeepSeek reference; vLLM omits it).
/// Butterfly stages h = 1, 2, ..., 64: (a, b) -> (a + b, a - b) for a = x[i], b = x[i+h], i & h == 0;
/// then every element is multiplied by 128^-0.5.
PCPKV_HD void hadamard128(float* x) {
  for (int h = 1; h < 128; h <<= 1)
    for (int i = 0; i < 128; ++i)
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = fp32::add(a, b);
        x[i + h] = fp32::sub(a, b);
      }
  for (int i = 0; i < 128; ++i) x[i] = fp32::mul(x[i], kHadamard128Scale);
}

}  // namespace pcpkv::math
