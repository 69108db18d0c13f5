// tests/support/random_bf16.h: seeded random test data with LLM-like outlier channels.
//
// Never test on zeros: these produce non-zero values of varying magnitude per row, with a few channels
// 20-50x larger than the rest (the statistics that break per-tile and per-row scales). Deterministic in
// (seed, index) only, so any subset of rows regenerates identically.
#pragma once

#include <cstdint>
#include <vector>

namespace pcpkv::test {

/// [rows, width] bf16 bit patterns: N(0, 1) * scale * row magnitude (log-normal, sigma 0.5) * outlier gain,
/// with num_outliers distinct channels (0..4) of gain 20..50. No value is zero or non-finite.
std::vector<uint16_t> random_bf16(int64_t rows, int64_t width, uint64_t seed, int num_outliers = 3,
                                  double scale = 1.0);

/// [n] fp32 values mean + spread * N(0, 1), rounded to bf16 precision (checkpoint weights), never zero.
std::vector<float> random_weights(int64_t n, uint64_t seed, double mean = 1.0, double spread = 0.25);

/// A stateless 64-bit hash of (seed, index) (splitmix64 finalizer), for tests that need their own draws.
uint64_t hash64(uint64_t seed, uint64_t index);

}  // namespace pcpkv::test
