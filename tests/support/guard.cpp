#include "support/guard.h"

#include <cstring>

namespace pcpkv::test {

void fill_guard(void* p, int64_t n) { std::memset(p, kGuardByte, static_cast<size_t>(n)); }

::testing::AssertionResult all_guard(const void* p, int64_t n, const std::string& what) {
  const auto* b = static_cast<const uint8_t*>(p);
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i)
    if (b[i] != kGuardByte) {
      if (first < 0) first = i;
      ++bad;
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << n << " bytes changed; first at byte "
                                       << first << " = 0x" << std::hex << static_cast<int>(b[first])
                                       << " (expected 0x" << static_cast<int>(kGuardByte) << ")";
}

GuardedBuffer::GuardedBuffer(int64_t size, int64_t guard)
    : size_(size), guard_(guard), bytes_(static_cast<size_t>(size + 2 * guard), kGuardByte) {}

::testing::AssertionResult GuardedBuffer::guards_intact(const std::string& what) const {
  auto r = all_guard(bytes_.data(), guard_, what + " (guard before)");
  if (!r) return r;
  return all_guard(bytes_.data() + guard_ + size_, guard_, what + " (guard after)");
}

::testing::AssertionResult GuardedBuffer::untouched(const std::string& what) const {
  return all_guard(bytes_.data(), size_ + 2 * guard_, what);
}

}  // namespace pcpkv::test
