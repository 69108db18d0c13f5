// CPU reference of the LSE merge (SPEC section 6): fp64 math, one rounding to fp32.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "pcpkv/core/error.h"
#include "pcpkv/consumers/lse_merge.h"

namespace pcpkv {

namespace {
constexpr double kU = 1.0 / 16777216.0;  // 2^-24
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

/// NaN and +inf count as -inf (an empty or broken shard contributes nothing).
double usable(float lse) { return (std::isnan(lse) || lse == std::numeric_limits<float>::infinity()) ? kNegInf : lse; }

/// m and L of row r in fp64; L = -inf when every shard is empty.
void row_stats(const LseMergeParams& p, int64_t r, double* m_out, double* L_out) {
  double m = kNegInf;
  for (int32_t n = 0; n < p.num_shards; ++n) m = std::max(m, usable(p.lses[n * p.num_rows + r]));
  double L = kNegInf;
  if (m != kNegInf) {
    double sum = 0.0;
    for (int32_t n = 0; n < p.num_shards; ++n) {
      const double l = usable(p.lses[n * p.num_rows + r]);
      if (l != kNegInf) sum += std::exp(l - m);
    }
    L = std::log(sum) + m;
  }
  *m_out = m;
  *L_out = L;
}
}  // namespace

void validate_lse_merge(const LseMergeParams& p) {
  PCPKV_CHECK(p.num_shards >= 1, "lse_merge: num_shards must be >= 1, got {}", p.num_shards);
  PCPKV_CHECK(p.num_rows >= 0, "lse_merge: num_rows must be >= 0, got {}", p.num_rows);
  PCPKV_CHECK(p.head_dim >= 1, "lse_merge: head_dim must be >= 1, got {}", p.head_dim);
  if (p.num_rows == 0) return;
  PCPKV_CHECK(p.outs && p.lses && p.out && p.lse, "lse_merge: outs, lses, out and lse must be non-null");
}

void lse_merge_reference(const LseMergeParams& p) {
  validate_lse_merge(p);
  const int64_t D = p.head_dim;
  std::vector<double> weights;
  for (int64_t r = 0; r < p.num_rows; ++r) {
    double m, L;
    row_stats(p, r, &m, &L);
    float* out = p.out + r * D;
    if (L == kNegInf) {
      std::fill(out, out + D, 0.0f);
      p.lse[r] = -std::numeric_limits<float>::infinity();
      continue;
    }
    // Weights once per row; an empty shard (weight -1 here) is never read: its out may hold NaN.
    weights.assign(p.num_shards, -1.0);
    for (int32_t n = 0; n < p.num_shards; ++n) {
      const double l = usable(p.lses[n * p.num_rows + r]);
      if (l != kNegInf) weights[n] = std::exp(l - L);
    }
    for (int64_t d = 0; d < D; ++d) {
      double acc = 0.0;
      for (int32_t n = 0; n < p.num_shards; ++n)
        if (weights[n] >= 0.0) acc += weights[n] * static_cast<double>(p.outs[(n * p.num_rows + r) * D + d]);
      out[d] = static_cast<float>(acc);
    }
    p.lse[r] = static_cast<float>(L);
  }
}

double LseMergeBound::lse_bound(const LseMergeParams& in, int64_t row, double ref) {
  double max_abs = 0.0;
  for (int32_t n = 0; n < in.num_shards; ++n) {
    const double l = usable(in.lses[n * in.num_rows + row]);
    if (l != kNegInf) max_abs = std::max(max_abs, std::fabs(l));
  }
  const double r = std::isfinite(ref) ? std::fabs(ref) : 0.0;
  return 4.0 * kU * (r + max_abs + 1.0) + (in.num_shards + 8.0) * kU;
}

double LseMergeBound::out_bound(const LseMergeParams& in, int64_t row, int32_t d, double ref) {
  double m, L;
  row_stats(in, row, &m, &L);
  if (L == kNegInf) return 1e-30;
  double max_abs = 0.0, weighted = 0.0;
  for (int32_t n = 0; n < in.num_shards; ++n) {
    const double l = usable(in.lses[n * in.num_rows + row]);
    if (l == kNegInf) continue;
    max_abs = std::max(max_abs, std::fabs(l));
    weighted += std::exp(l - L) * std::fabs(static_cast<double>(in.outs[(n * in.num_rows + row) * in.head_dim + d]));
  }
  const double rel = 8.0 * kU * (std::fabs(L) + max_abs + 1.0) + (2.0 * in.num_shards + 16.0) * kU;
  return rel * weighted + 2.0 * kU * std::fabs(ref) + 1e-30;
}

}  // namespace pcpkv
