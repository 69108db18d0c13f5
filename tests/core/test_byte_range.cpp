// pcpkv-test-labels: unit
// pcpkv/core/byte_range.h: the one overlap rule of the kernel parameter checks and of python/csrc's torch ops.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "pcpkv/core/byte_range.h"

namespace pcpkv {
namespace {

const void* at(uintptr_t a) { return reinterpret_cast<const void*>(a); }

TEST(ByteRange, EmptyNullAndSaturatedRanges) {
  const ByteRange r = byte_range(at(0x1000), 16);
  EXPECT_EQ(r.lo, 0x1000u);
  EXPECT_EQ(r.hi, 0x1010u);
  EXPECT_EQ(byte_range(nullptr, 16).hi, 0u);  // null: no memory
  EXPECT_EQ(byte_range(at(0x1000), 0).lo, byte_range(at(0x1000), 0).hi);
  // Past the end of the address space: saturated, not wrapped to below lo.
  const ByteRange big = byte_range(at(UINTPTR_MAX - 8), 64);
  EXPECT_EQ(big.lo, UINTPTR_MAX - 8);
  EXPECT_EQ(big.hi, UINTPTR_MAX);
  EXPECT_EQ(byte_range(at(0x1000), UINT64_MAX).hi, UINTPTR_MAX);
}

TEST(ByteRange, FirstOverlapIndexesWritesThenReads) {
  using Hit = std::optional<std::pair<size_t, size_t>>;
  const ByteRange a = byte_range(at(0x1000), 0x100), b = byte_range(at(0x1100), 0x100);  // adjacent: no byte shared
  const ByteRange in_a = byte_range(at(0x10ff), 1), in_b = byte_range(at(0x1100), 1);
  EXPECT_EQ(first_overlap({a, b}, {}, true), std::nullopt);
  EXPECT_EQ(first_overlap({a, b, in_b}, {}, true), (Hit{{1, 2}}));
  EXPECT_EQ(first_overlap({a, in_a}, {}, false), std::nullopt);  // writes not compared with each other
  EXPECT_EQ(first_overlap({b}, {a, in_b}, false), (Hit{{0, 2}}));  // j past the writes: reads[1]
  EXPECT_EQ(first_overlap({b}, {in_b, in_b}, true), (Hit{{0, 1}}));
  EXPECT_EQ(first_overlap({}, {a, a}, true), std::nullopt);      // reads may share memory
  EXPECT_EQ(first_overlap({a}, {ByteRange{}}, true), std::nullopt);  // an empty range overlaps nothing
  // Two address spaces (python/csrc: two devices) never overlap.
  EXPECT_EQ(first_overlap({a}, {byte_range(at(0x1000), 0x100, 1)}, true), std::nullopt);
}

// first_overlap answers "none" from a sorted sweep and searches the pairs only when some pair overlaps: on random
// sets (two spaces, empty ranges, nested, adjacent and equal ranges, more than the 64 of its stack buffer) it gives
// the pair, or none, that comparing every pair in the documented order gives.
TEST(ByteRange, FirstOverlapEqualsThePairwiseSearchOnRandomSets) {
  std::mt19937_64 rng(20261203);
  const auto pairwise = [](const std::vector<ByteRange>& w, const std::vector<ByteRange>& r, bool pw) {
    const auto hit = [](const ByteRange& a, const ByteRange& b) {
      return a.lo < a.hi && b.lo < b.hi && a.space == b.space && a.lo < b.hi && b.lo < a.hi;
    };
    for (size_t i = 0; i < w.size(); ++i)
      for (size_t j = pw ? i + 1 : w.size(); j < w.size() + r.size(); ++j)
        if (hit(w[i], j < w.size() ? w[j] : r[j - w.size()])) return std::optional<std::pair<size_t, size_t>>({i, j});
    return std::optional<std::pair<size_t, size_t>>();
  };
  int found = 0, none = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const size_t nw = rng() % (trial % 100 == 0 ? 90 : 12), nr = rng() % (trial % 100 == 0 ? 40 : 12);
    const uintptr_t span = 64 + rng() % 4096;  // small spans: overlaps are common; large: rare
    std::vector<ByteRange> w(nw), r(nr);
    for (auto* v : {&w, &r})
      for (ByteRange& x : *v) {
        const uintptr_t lo = 0x10000 + (rng() % span) * 16;
        const uintptr_t len = rng() % 5 == 0 ? 0 : 16 * (1 + rng() % 8);
        x = byte_range(at(lo), len, static_cast<int64_t>(rng() % 2));
      }
    const bool pw = rng() % 2 == 0;
    const auto want = pairwise(w, r, pw);
    ASSERT_EQ(first_overlap(w, r, pw), want) << "trial " << trial;
    (want ? found : none)++;
  }
  EXPECT_GT(found, 1000);  // both outcomes exercised
  EXPECT_GT(none, 1000);
}

}  // namespace
}  // namespace pcpkv
