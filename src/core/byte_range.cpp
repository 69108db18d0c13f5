// Byte extents and the overlap rule of pcpkv/core/byte_range.h.
#include "pcpkv/core/byte_range.h"

namespace pcpkv {

ByteRange byte_range(const void* p, uint64_t num_bytes, int64_t space) {
  if (p == nullptr || num_bytes == 0) return {0, 0, space};
  const auto lo = reinterpret_cast<uintptr_t>(p);
  const uintptr_t n = num_bytes > UINTPTR_MAX ? UINTPTR_MAX : static_cast<uintptr_t>(num_bytes);
  return {lo, n > UINTPTR_MAX - lo ? UINTPTR_MAX : lo + n, space};
}

std::optional<std::pair<size_t, size_t>> first_overlap(const std::vector<ByteRange>& writes,
                                                       const std::vector<ByteRange>& reads, bool writes_pairwise) {
  const size_t n = writes.size() + reads.size();
  for (size_t i = 0; i < writes.size(); ++i)
    for (size_t j = writes_pairwise ? i + 1 : writes.size(); j < n; ++j) {
      const ByteRange &a = writes[i], &b = j < writes.size() ? writes[j] : reads[j - writes.size()];
      if (a.lo < a.hi && b.lo < b.hi && a.space == b.space && a.lo < b.hi && b.lo < a.hi)
        return std::make_pair(i, j);
    }
  return std::nullopt;
}

}  // namespace pcpkv
