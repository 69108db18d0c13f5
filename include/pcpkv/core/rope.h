// pcpkv/core/rope.h: cos/sin tables of the 64 rotary dims (SPEC section 1).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/core/model.h"

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

/// Refuses unusable RoPE parameters (SPEC section 1): throws pcpkv::Error naming `origin`, the key (after
/// `prefix`, where the scaling keys live: "rope_scaling.", "rope_parameters.", "rope.") and its value.
/// rope_theta must be in (1, 1e12]; with YaRN also factor in [1, 1e4], original_max_position_embeddings
/// in [1, 2^40], beta_fast >= beta_slow in (0, 1e4], mscale / mscale_all_dim in [0, 1e3], and the
/// resulting magnitude and inverse frequencies finite and positive.
void validate_rope(const RopeConfig& rope, const std::string& origin, const std::string& prefix);

/// Builds the table for positions [0, num_positions). Throws pcpkv::Error if num_positions < 1.
RopeTable make_rope_table(const RopeConfig& rope, int64_t num_positions);

/// The exact (long double) cos and sin of pair i at position pos, for the fp64 oracle.
void rope_exact(const RopeConfig& rope, int64_t pos, int pair, long double* cos_out, long double* sin_out);

}  // namespace pcpkv
