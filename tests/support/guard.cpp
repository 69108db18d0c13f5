#include "support/guard.h"

#include <algorithm>
#include <cstring>

#include "pcpkv/publish/checks.h"

namespace pcpkv::test {

void fill_guard(void* p, int64_t n) { std::memset(p, kGuardByte, static_cast<size_t>(n)); }

::testing::AssertionResult all_guard(const void* p, int64_t n, const std::string& what) {
  const ByteDiff d = compare_to_guard(p, std::max<int64_t>(n, 0));
  if (d.equal()) return ::testing::AssertionSuccess();
  const auto* b = static_cast<const uint8_t*>(p);
  return ::testing::AssertionFailure() << what << ": " << d.num_diff << " of " << n << " bytes changed; first at byte "
                                       << d.first_diff << " = 0x" << std::hex << static_cast<int>(b[d.first_diff])
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
