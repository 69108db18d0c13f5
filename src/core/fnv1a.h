// FNV-1a, 64-bit: the small digest pcpkv compares where cooperating processes must hold the same thing (a command
// line, a run's configuration, a file, replica bytes in a test). It finds accidents, not forgeries.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pcpkv {

inline constexpr uint64_t kFnv1aBasis = 1469598103934665603ull;

/// Continues the digest `h` over `size` bytes at `data` (start with kFnv1aBasis).
inline uint64_t fnv1a(const void* data, size_t size, uint64_t h = kFnv1aBasis) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace pcpkv
