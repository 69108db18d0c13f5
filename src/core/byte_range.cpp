// Byte extents and the overlap rule of pcpkv/core/byte_range.h.
#include "pcpkv/core/byte_range.h"

#include <algorithm>
#include <array>
#include <tuple>

namespace pcpkv {

ByteRange byte_range(const void* p, uint64_t num_bytes, int64_t space) {
  if (p == nullptr || num_bytes == 0) return {0, 0, space};
  const auto lo = reinterpret_cast<uintptr_t>(p);
  const uintptr_t n = num_bytes > UINTPTR_MAX ? UINTPTR_MAX : static_cast<uintptr_t>(num_bytes);
  return {lo, n > UINTPTR_MAX - lo ? UINTPTR_MAX : lo + n, space};
}

namespace {

struct SweepItem {
  int64_t space;
  uintptr_t lo, hi;
  bool write;
};

bool overlap(const ByteRange& a, const ByteRange& b) {
  return a.lo < a.hi && b.lo < b.hi && a.space == b.space && a.lo < b.hi && b.lo < a.hi;
}

// Whether any pair that first_overlap compares shares a byte, by one sweep over the ranges sorted by (space, lo):
// a range overlaps an earlier one exactly when that one's hi is past its lo. Every launch runs this (at PCP 8, 8
// dispatch jobs of ~34 ranges each), so the host time of an eager layer counts it (docs/perf.md 31).
bool any_overlap(SweepItem* items, const std::vector<ByteRange>& writes, const std::vector<ByteRange>& reads,
                 bool writes_pairwise) {
  size_t m = 0;
  for (size_t i = 0; i < writes.size() + reads.size(); ++i) {
    const bool is_write = i < writes.size();
    const ByteRange& r = is_write ? writes[i] : reads[i - writes.size()];
    if (r.lo < r.hi) items[m++] = SweepItem{r.space, r.lo, r.hi, is_write};
  }
  std::sort(items, items + m,
            [](const SweepItem& a, const SweepItem& b) { return std::tie(a.space, a.lo) < std::tie(b.space, b.lo); });
  uintptr_t hi_w = 0, hi_r = 0;  // the largest hi among the writes / reads seen in this space
  for (size_t i = 0; i < m; ++i) {
    const SweepItem& x = items[i];
    if (i > 0 && x.space != items[i - 1].space) hi_w = hi_r = 0;
    if (x.write ? (hi_r > x.lo || (writes_pairwise && hi_w > x.lo)) : hi_w > x.lo) return true;
    (x.write ? hi_w : hi_r) = std::max(x.write ? hi_w : hi_r, x.hi);
  }
  return false;
}

}  // namespace

std::optional<std::pair<size_t, size_t>> first_overlap(const std::vector<ByteRange>& writes,
                                                       const std::vector<ByteRange>& reads, bool writes_pairwise) {
  const size_t n = writes.size() + reads.size();
  // The common case, no overlap, in O(n log n) without a heap allocation for the few regions of one call.
  constexpr size_t kStack = 64;
  bool any;
  if (n <= kStack) {
    std::array<SweepItem, kStack> items;
    any = any_overlap(items.data(), writes, reads, writes_pairwise);
  } else {
    std::vector<SweepItem> items(n);
    any = any_overlap(items.data(), writes, reads, writes_pairwise);
  }
  if (!any) return std::nullopt;
  // Some pair overlaps: the first in the documented order, by comparing every pair (an error path).
  for (size_t i = 0; i < writes.size(); ++i)
    for (size_t j = writes_pairwise ? i + 1 : writes.size(); j < n; ++j)
      if (overlap(writes[i], j < writes.size() ? writes[j] : reads[j - writes.size()])) return std::make_pair(i, j);
  return std::nullopt;
}

}  // namespace pcpkv
