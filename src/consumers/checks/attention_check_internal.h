// Private helpers of src/consumers/checks/attention_check*.cpp (not installed): the seeded rows and their cache
// encodings that the attention check, its tests and its bench build inputs from.
#pragma once

#include <cstdint>

#include "pcpkv/core/layout.h"

namespace pcpkv::attention_inputs {

/// splitmix64 stream with uniform (0, 1) and Box-Muller normals.
struct Rng {
  uint64_t state;
  uint64_t next();
  double uniform();
  double normal();
};

/// n values, N(0, sigma^2) times a per-row log-normal magnitude, with a few outlier channels.
void random_row(Rng& rng, float* x, int n, double sigma, int salt);

/// One MLA cache row of format fmt (SPEC section 3) from fp32 kv_c[512], k_pe[64].
void encode_mla_row(const float* kv_c, const float* k_pe, const CacheFormat& fmt, uint8_t* row);

/// One indexer-K slot (128 E4M3 + UE8M0 fp32 scale) from fp32 k[128].
void encode_index_row(const float* k, uint8_t* data, uint8_t* scale);

}  // namespace pcpkv::attention_inputs
