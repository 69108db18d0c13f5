// pcpkv/core/byte_range.h: the one overlap rule of the kernel parameter checks and of python/csrc's torch ops.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
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

}  // namespace
}  // namespace pcpkv
