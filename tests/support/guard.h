// tests/support/guard.h: guard-byte fill and check (poison outputs before runs, prove regions untouched).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"  // kGuardByte

namespace pcpkv::test {

/// Fills n bytes at p with kGuardByte (0xA5).
void fill_guard(void* p, int64_t n);

/// Success when every byte of [p, p + n) equals kGuardByte (pcpkv::compare_to_guard, the count behind
/// check_untouched); otherwise names `what`, the count of changed bytes and the first one:
/// "mla guard: 3 of 256 bytes changed; first at byte 17 = 0x00 (expected 0xa5)".
::testing::AssertionResult all_guard(const void* p, int64_t n, const std::string& what);

/// A payload of `size` bytes framed by `guard` bytes of kGuardByte on each side; the payload starts
/// poisoned with kGuardByte too. Checks that nothing wrote outside the payload.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(int64_t size, int64_t guard = 256);
  uint8_t* data() { return bytes_.data() + guard_; }
  const uint8_t* data() const { return bytes_.data() + guard_; }
  int64_t size() const { return size_; }
  /// Both guards intact.
  ::testing::AssertionResult guards_intact(const std::string& what) const;
  /// Guards intact and the payload untouched (still all kGuardByte).
  ::testing::AssertionResult untouched(const std::string& what) const;

 private:
  int64_t size_, guard_;
  std::vector<uint8_t> bytes_;
};

}  // namespace pcpkv::test
