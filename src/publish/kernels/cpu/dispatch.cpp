// CPU reference of the fused dispatch (SPEC section 2): Q RMSNorm, KV RMSNorm, k_pe RoPE, indexer
// LayerNorm + RoPE (+ optional Hadamard), quantization (SPEC section 3), cache and transport-row writes.
// Rounding order: pcpkv/device/token_math.h. Conversions: pcpkv/device/codec.h via pack.h.
#include <cstring>

#include "core/parallel.h"
#include "publish/kernels/cpu/rows.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/core/model.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/pack.h"
#include "pcpkv/device/token_math.h"

namespace pcpkv {
namespace {

using cpu_detail::encode_transport_row;
using cpu_detail::kMaxRowBytes;

void bf16_row_to_float(const uint16_t* in, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = codec::bf16_to_float(in[i]);
}

// Canonical sum of squares (token_math.h): sequential leaves of 8, then the pairwise tree over leaves.
float canonical_sumsq(const float* x, int n) {
  float leaves[kMaxQLoraRank / math::kLeaf];  // n <= kMaxQLoraRank (validate_dispatch_shape)
  const int m = n / math::kLeaf;
  for (int j = 0; j < m; ++j) leaves[j] = math::leaf_sumsq(x + j * math::kLeaf);
  return math::pairwise_sum(leaves, m);
}
float canonical_sum(const float* x, int n) {
  float leaves[512];
  const int m = n / math::kLeaf;
  for (int j = 0; j < m; ++j) leaves[j] = math::leaf_sum(x + j * math::kLeaf);
  return math::pairwise_sum(leaves, m);
}

// The row x * kRescale (token_math.h overflow guard), into out.
void rescaled_row(const float* x, int n, float* out) {
  for (int j = 0; j < n; j += math::kLeaf) {
    for (int k = 0; k < math::kLeaf; ++k) out[j + k] = x[j + k];
    math::rescale_leaf(out + j);
  }
}

// RMSNorm in place (SPEC 2.1, 2.2): y = (x * r) * w, r = 1 / sqrt(sumsq / n + eps). A row whose sum of squares
// overflows is normalized from x * 2^-72 with eps * 2^-144 (token_math.h overflow guard; the same formula).
void rms_norm(float* x, int n, const float* w, float eps) {
  float sumsq = canonical_sumsq(x, n);
  if (!math::finite(sumsq)) {
    float xs[4096];
    rescaled_row(x, n, xs);
    const float s = canonical_sumsq(xs, n);
    if (math::use_rescaled(sumsq, s)) {
      std::memcpy(x, xs, sizeof(float) * static_cast<size_t>(n));
      sumsq = s;
      eps = math::rescaled_eps(eps);
    }
  }
  const float r = math::rms_inv(sumsq, n, eps);
  for (int i = 0; i < n; ++i) x[i] = math::rms_apply(x[i], r, w[i]);
}

// LayerNorm statistics over 128: d = x - mu with mu = sum / n; returns sumsq(d).
float center128(const float* x, float* d) {
  const float mu = math::mean_of(canonical_sum(x, 128), 128);
  for (int i = 0; i < 128; ++i) d[i] = fp32::sub(x[i], mu);
  return canonical_sumsq(d, 128);
}

// LayerNorm over 128 in place (SPEC 2.4): mu = sum / n, d = x - mu, r = 1 / sqrt(sumsq(d) / n + eps),
// y = (d * r) * w + b (biased variance). A row whose sums overflow is normalized from x * 2^-72 with
// eps * 2^-144 (token_math.h overflow guard).
void layer_norm128(float* x, const float* w, const float* b, float eps) {
  float d[128];
  float var = center128(x, d);
  if (!math::finite(var)) {
    float xs[128], ds[128];
    rescaled_row(x, 128, xs);
    const float v = center128(xs, ds);
    if (math::use_rescaled(var, v)) {
      std::memcpy(d, ds, sizeof(d));
      var = v;
      eps = math::rescaled_eps(eps);
    }
  }
  const float r = math::rms_inv(var, 128, eps);
  for (int i = 0; i < 128; ++i) x[i] = math::ln_apply(d[i], r, w[i], b[i]);
}

// The fp32 values of one token that the cache write quantizes (and the collect path materializes).
struct TokenValues {
  float kv_c[512];
  float k_pe[64];
  float index_k[128];
};

void compute_token(const DispatchParams& p, int64_t t, TokenValues& v) {
  bf16_row_to_float(p.kv + t * p.kv_stride, 512, v.kv_c);
  rms_norm(v.kv_c, 512, p.kv_norm_w, p.kv_eps);
  const float* cs = p.rope_cos_sin + p.positions[t] * kRopeDims;
  bf16_row_to_float(p.k_pe + t * p.k_pe_stride, 64, v.k_pe);
  math::rope64(v.k_pe, cs, p.mla_rope == RopeStyle::kInterleaved);
  if (p.fmt.has_indexer) {
    bf16_row_to_float(p.index_k + t * p.index_k_stride, 128, v.index_k);
    layer_norm128(v.index_k, p.index_ln_w, p.index_ln_b, p.index_eps);
    // Indexer layout is rope-first: [pe 64 | nope 64]; RoPE touches dims [0, 64) only.
    math::rope64(v.index_k, cs, p.index_rope == RopeStyle::kInterleaved);
    if (p.index_hadamard) math::hadamard128(v.index_k);
  }
}

#if defined(__GNUC__)
#define PCPKV_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PCPKV_ALWAYS_INLINE inline
#endif

PCPKV_ALWAYS_INLINE void dispatch_range_body(const DispatchParams& p, int64_t begin, int64_t end) {
  const TransportRowLayout layout = transport_row_layout(p.fmt);
  const bool need_kv = p.kv_c_out || p.k_pe_out || p.index_k_out || p.num_targets > 0 || p.num_row_dests > 0;
  const int64_t topk_first = topk_fill_first_row(p.topk_fill_mode, p.topk_indexer_rows, p.num_tokens);
  float q[4096];
  TokenValues v;
  alignas(16) uint8_t row[kMaxRowBytes];
  for (int64_t t = begin; t < end; ++t) {
    if (p.q_c_out) {
      const int n = static_cast<int>(p.q_lora_rank);
      bf16_row_to_float(p.q_c + t * p.q_c_stride, n, q);
      rms_norm(q, n, p.q_norm_w, p.q_eps);
      uint16_t* out = p.q_c_out + t * p.q_lora_rank;
      for (int i = 0; i < n; ++i) out[i] = codec::float_to_bf16(q[i]);
    }
    if (p.topk_fill && t >= topk_first) {
      int32_t* out = p.topk_fill + t * p.topk_width;
      for (int64_t i = 0; i < p.topk_width; ++i) out[i] = -1;
    }
    if (!need_kv) continue;
    compute_token(p, t, v);
    if (p.kv_c_out)
      for (int i = 0; i < 512; ++i) p.kv_c_out[t * 512 + i] = codec::float_to_bf16(v.kv_c[i]);
    if (p.k_pe_out)
      for (int i = 0; i < 64; ++i) p.k_pe_out[t * 64 + i] = codec::float_to_bf16(v.k_pe[i]);
    if (p.index_k_out)
      for (int i = 0; i < 128; ++i) p.index_k_out[t * 128 + i] = codec::float_to_bf16(v.index_k[i]);
    const int64_t slot = p.slot_mapping ? p.slot_mapping[t] : -1;
    const int64_t index_slot = p.indexer_slot_mapping ? p.indexer_slot_mapping[t] : slot;
    const bool to_caches = p.num_targets > 0 && (slot >= 0 || index_slot >= 0);
    if (!to_caches && p.num_row_dests == 0) continue;
    encode_transport_row(v.kv_c, v.k_pe, v.index_k, p.fmt, layout, row);
    if (to_caches)
      for (int32_t d = 0; d < p.num_targets; ++d)
        cpu_detail::write_cache_row(p.targets[d], layout, slot, index_slot, row);
    for (int32_t d = 0; d < p.num_row_dests; ++d)
      std::memcpy(p.row_dests[d] + t * p.row_bytes, row, static_cast<size_t>(p.row_bytes));
  }
}

// Two builds of the loop, picked at run time: with the FMA extension fp32::fma (std::fma) inlines to one
// vfmadd instead of a libm call (the norms run ~4x faster); both round exactly once, so the bytes are the same
// (-ffp-contract=off still forbids contracting separate multiplies and adds). A run-time check rather than
// target_clones: ifunc resolvers run before sanitizer runtimes start.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("fma"))) void dispatch_range_fma(const DispatchParams& p, int64_t begin, int64_t end) {
  dispatch_range_body(p, begin, end);
}
#endif

void dispatch_range(const DispatchParams& p, int64_t begin, int64_t end) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has_fma = __builtin_cpu_supports("fma");
  if (has_fma) return dispatch_range_fma(p, begin, end);
#endif
  dispatch_range_body(p, begin, end);
}

}  // namespace

void dispatch_reference(const DispatchParams& p, int num_threads) {
  validate_dispatch(p);
  cpu_detail::parallel_for(p.num_tokens, num_threads,
                           [&](int64_t begin, int64_t end) { dispatch_range(p, begin, end); });
}

}  // namespace pcpkv
