// tests/support/huge_rows.h: inputs whose norms overflow fp32 (finite bf16 values up to the bf16 maximum,
// ~2^128): the rows the dispatch's overflow guard (pcpkv/device/token_math.h) normalizes from x * 2^-72
// instead of publishing zeros, mixed with ordinary rows and rows just below the overflow.
#pragma once

#include <cstdint>
#include <vector>

#include "pcpkv/core/inputs.h"

namespace pcpkv::test {

/// Row patterns, by kind: 0 an ordinary row with one element +-2^100; 1 every element +-bf16 max; 2 the first
/// half +max, the second half -max (the LayerNorm partial sums overflow to +inf and -inf: NaN); 3 every element
/// +-2^61 (no single square overflows, the sum does); 4 magnitudes log-uniform in [2^-40, 2^120] (elements
/// far below the row's scale, which the rescaling takes into the subnormal range); 5 every element +-2^56
/// (just below the overflow: the ordinary path).
constexpr int kHugeRowKinds = 6;

/// Overwrites the q_c, kv and index_k rows (k_pe, which no norm reads, stays) of the global tokens
/// first, first + every, ... with pattern (i % kHugeRowKinds) for the i-th of them. Returns those tokens.
std::vector<int64_t> make_rows_huge(GlobalInputs& in, int64_t first = 0, int64_t every = 2, uint64_t seed = 7);

}  // namespace pcpkv::test
