// pcpkv/rope.h: cos/sin tables of the 64 rotary dims (SPEC section 1).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "pcpkv/model.h"

namespace pcpkv {

constexpr int kRopeDim = 64;
constexpr int kRopePairs = 32;

/// Per-pair inverse frequencies f'_i, i = 0..31, in long double (YaRN-corrected when configured).
std::array<long double, kRopePairs> rope_inv_freq(const RopeConfig& rope);

/// YaRN magnitude factor applied to cos and sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim)
/// with mscale(s, m) = 1 for s <= 1, else 0.1 * m * ln(s) + 1. 1 for the default rope.
long double rope_mscale(const RopeConfig& rope);

/// cos/sin table, fp32, [num_positions, 64] = per position [cos(pos*f'_0..31) | sin(pos*f'_0..31)] * mscale,
/// each computed in long double and rounded once to float. Positions are token positions (int64).
struct RopeTable {
  int64_t num_positions = 0;
  std::vector<float> cos_sin;  // [num_positions, 64]
  const float* row(int64_t pos) const { return cos_sin.data() + pos * kRopeDim; }
};

/// Builds the table for positions [0, num_positions). Throws pcpkv::Error if num_positions < 1.
RopeTable make_rope_table(const RopeConfig& rope, int64_t num_positions);

/// The exact (long double) cos and sin of pair i at position pos, for the fp64 oracle.
void rope_exact(const RopeConfig& rope, int64_t pos, int pair, long double* cos_out, long double* sin_out);

}  // namespace pcpkv
