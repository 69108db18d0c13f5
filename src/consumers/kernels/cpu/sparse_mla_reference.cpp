// CPU reference of sparse MLA attention (SPEC section 6): fp64 accumulation, one rounding to fp32.
#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "core/parallel.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/consumers.h"
#include "pcpkv/core/error.h"
#include "pcpkv/consumers/sparse_mla.h"

namespace pcpkv {

float sparse_mla_softmax_scale(double softmax_scale) {
  if (const auto why = scale_problem(softmax_scale))
    PCPKV_FAIL("sparse_mla: softmax_scale = {} {}", softmax_scale, *why);
  return static_cast<float>(softmax_scale);
}

void validate_sparse_mla_scales(const SparseMlaParams& p) {
  // The float32 fields, named as floats (sparse_mla_softmax_scale names a double's value).
  if (const auto why = scale_problem(p.softmax_scale))
    PCPKV_FAIL("sparse_mla: softmax_scale = {} {}", p.softmax_scale, *why);
  if (p.fmt.kv_format == KvFormat::kFp8) {
    if (const auto why = scale_problem(p.fmt.k_scale)) PCPKV_FAIL("sparse_mla: k_scale = {} {}", p.fmt.k_scale, *why);
  }
}

void validate_sparse_mla(const SparseMlaParams& p) {
  PCPKV_CHECK(p.num_tokens >= 0, "sparse_mla: num_tokens must be >= 0, got {}", p.num_tokens);
  PCPKV_CHECK(p.num_heads >= 1, "sparse_mla: num_heads must be >= 1, got {}", p.num_heads);
  PCPKV_CHECK(p.topk >= 1, "sparse_mla: topk must be >= 1, got {}", p.topk);
  validate_sparse_mla_scales(p);
  validate_geometry(p.geometry, p.fmt.kv_format);
  if (p.num_tokens == 0) return;
  PCPKV_CHECK(p.q && p.mla_cache && p.indices && p.out && p.lse,
              "sparse_mla: q, mla_cache, indices, out and lse must be non-null");
  const int64_t num_slots = p.geometry.num_slots();
  for (int64_t t = 0; t < p.num_tokens; ++t)
    for (int32_t i = 0; i < p.topk; ++i) {
      const int32_t s = p.indices[t * p.topk + i];
      PCPKV_CHECK(s >= -1 && s < num_slots, "sparse_mla: indices[{}, {}] = {} is out of range [-1, {})", t, i,
                  s, num_slots);
    }
}

namespace {

/// Attention of every head of token t (fp64), written to p.out / p.lse (and stats).
void attend_token(const SparseMlaParams& p, int64_t t, double scale, SparseMlaRefStats* stats, std::vector<float>& kv,
                  std::vector<double>& s, std::vector<double>& a, std::vector<double>& q, std::vector<double>& acc,
                  std::vector<double>& acc_abs) {
  constexpr int kQk = consumers::kMlaQkDim, kV = consumers::kMlaVDim;
  const int H = p.num_heads;
  kv.clear();
  for (int32_t i = 0; i < p.topk; ++i) {
    const int32_t slot = p.indices[t * p.topk + i];
    if (slot < 0) continue;
    const uint8_t* row = p.mla_cache + p.geometry.row_offset(slot);
    const size_t at = kv.size();
    kv.resize(at + kQk);
    for (int c = 0; c < kQk / 8; ++c)
      consumers::mla_decode_chunk(row, p.fmt.kv_format, p.fmt.k_scale, c, &kv[at + 8 * c],
                                   p.scales_as_bf16);
  }
  const int64_t K = static_cast<int64_t>(kv.size()) / kQk;
  if (stats) stats->num_keys[t] = static_cast<int32_t>(K);
  s.resize(K);
  a.resize(K);
  for (int h = 0; h < H; ++h) {
    const int64_t th = t * H + h;
    float* out = p.out + th * kV;
    if (K == 0) {
      std::fill(out, out + kV, 0.0f);
      p.lse[th] = -std::numeric_limits<float>::infinity();
      continue;
    }
    for (int d = 0; d < kQk; ++d) q[d] = codec::bf16_to_float(p.q[th * kQk + d]);
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < K; ++j) {
      double dot = 0.0, dot_abs = 0.0;
      for (int d = 0; d < kQk; ++d) {
        const double prod = q[d] * static_cast<double>(kv[j * kQk + d]);
        dot += prod;
        dot_abs += std::fabs(prod);
      }
      s[j] = scale * dot;
      a[j] = scale * dot_abs;
      m = std::max(m, s[j]);
    }
    double l = 0.0, max_a = 0.0;
    std::fill(acc.begin(), acc.end(), 0.0);
    std::fill(acc_abs.begin(), acc_abs.end(), 0.0);
    for (int64_t j = 0; j < K; ++j) {
      const double e = std::exp(s[j] - m);
      l += e;
      max_a = std::max(max_a, a[j]);
      for (int d = 0; d < kV; ++d) {
        const double v = kv[j * kQk + d];
        acc[d] += e * v;
        acc_abs[d] += e * std::fabs(v);
      }
    }
    for (int d = 0; d < kV; ++d) out[d] = static_cast<float>(acc[d] / l);
    p.lse[th] = static_cast<float>(m + std::log(l));
    if (stats) {
      stats->max_abs_s[th] = max_a;
      for (int d = 0; d < kV; ++d) stats->abs_pv[th * kV + d] = acc_abs[d] / l;
    }
  }
}

}  // namespace

void sparse_mla_reference(const SparseMlaParams& p, SparseMlaRefStats* stats) {
  validate_sparse_mla(p);
  constexpr int kQk = consumers::kMlaQkDim, kV = consumers::kMlaVDim;
  const int H = p.num_heads;
  const double scale = p.softmax_scale;
  if (stats) {
    stats->abs_pv.assign(static_cast<size_t>(p.num_tokens) * H * kV, 0.0);
    stats->max_abs_s.assign(static_cast<size_t>(p.num_tokens) * H, 0.0);
    stats->num_keys.assign(static_cast<size_t>(p.num_tokens), 0);
  }
  // Tokens are independent: split them over threads (results do not depend on the split).
  const int num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_detail::parallel_for(p.num_tokens, num_threads, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> kv;       // [K, 576] decoded rows of the token's valid slots
    std::vector<double> s, a;    // [K] scores, scale * sum |q k|
    std::vector<double> q(kQk), acc(kV), acc_abs(kV);
    for (int64_t t = t_begin; t < t_end; ++t) attend_token(p, t, scale, stats, kv, s, a, q, acc, acc_abs);
  }, 2);
}

SparseMlaArith arith_of(SparseMlaKernel k) {
  return k == SparseMlaKernel::kMma ? SparseMlaArith::kBf16Mma : SparseMlaArith::kFp32;
}

const char* to_string(SparseMlaKernel k) {
  switch (k) {
    case SparseMlaKernel::kMma: return "mma";
    case SparseMlaKernel::kSimt: return "simt";
  }
  return "?";
}

namespace {
constexpr double kU = 1.0 / 16777216.0;  // 2^-24, fp32 unit roundoff
constexpr double kUbf16 = 1.0 / 256.0;   // 2^-8, bf16 unit roundoff (8 significant bits, round to nearest)
bool mma(SparseMlaArith a) { return a == SparseMlaArith::kBf16Mma; }
double score_delta(double max_abs_s, SparseMlaArith a) {
  return (mma(a) ? 4.0 * 576.0 + 16.0 : 576.0 + 8.0) * kU * max_abs_s;
}
/// Weight and sum roundings of K keys in at most min(K, 256) online-softmax tiles (exp, rescale, sums).
double sum_terms(double K, SparseMlaArith a) {
  return (mma(a) ? 2.0 : 1.0) * (2.0 * K + 16.0 * std::min(K, 256.0) + 64.0) * kU;
}
/// Rounding of the softmax weights fed to the PV product.
double p_round(SparseMlaArith a) { return mma(a) ? kUbf16 + kU : 0.0; }
}  // namespace

double SparseMlaBound::out_bound(double abs_pv, double max_abs_s, int32_t num_keys, double ref, double ref_lse,
                                 int dcp_shards, SparseMlaArith arith) {
  const double delta = score_delta(max_abs_s, arith);
  const double K = num_keys;
  const double one = 2.0 * delta + sum_terms(K, arith) + p_round(arith);  // one result against the exact value
  double rel = one;
  double abs_ref = 2.0 * kU * std::fabs(ref);
  if (dcp_shards > 0) {
    // The other side: shard partials (same form, fewer keys), merge weights moved by the partial LSEs'
    // errors (2x their bound), the merge's own rounding (lse_merge.h).
    const double lse_err = delta + sum_terms(K, arith) + 2.0 * kU * std::fabs(ref_lse);
    rel += one + 2.0 * lse_err + 8.0 * kU * (std::fabs(ref_lse) + 1.0) + (2.0 * dcp_shards + 16.0) * kU;
    abs_ref *= 2.0;
  }
  return rel * abs_pv + abs_ref + 1e-30;
}

double SparseMlaBound::lse_bound(double max_abs_s, int32_t num_keys, double ref, int dcp_shards,
                                 SparseMlaArith arith) {
  const double delta = score_delta(max_abs_s, arith);
  const double K = num_keys;
  const double one = delta + sum_terms(K, arith) + 2.0 * kU * std::fabs(ref);
  if (dcp_shards == 0) return one;
  return 2.0 * one + 4.0 * kU * (std::fabs(ref) + 1.0) + (dcp_shards + 8.0) * kU;
}

}  // namespace pcpkv
