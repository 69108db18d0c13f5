#include "support/bytes.h"

#include <algorithm>

#include <fmt/format.h>

#include "pcpkv/publish/checks.h"

namespace pcpkv::test {

::testing::AssertionResult bytes_equal(const void* expected, const void* actual, int64_t n, const std::string& what,
                                       const OffsetDescriber& describe) {
  const ByteDiff d = compare_bytes(expected, actual, std::max<int64_t>(n, 0));
  if (d.equal()) return ::testing::AssertionSuccess();
  const auto* a = static_cast<const uint8_t*>(expected);
  const auto* b = static_cast<const uint8_t*>(actual);
  const int64_t first = d.first_diff;
  const std::string where = describe ? fmt::format(" ({})", describe(first)) : std::string();
  return ::testing::AssertionFailure() << fmt::format(
             "{}: {} of {} bytes differ; first at byte {}{}: expected 0x{:02x}, got 0x{:02x}", what, d.num_diff, n,
             first, where, a[first], b[first]);
}

::testing::AssertionResult bytes_equal(const std::vector<uint8_t>& expected, const std::vector<uint8_t>& actual,
                                       const std::string& what, const OffsetDescriber& describe) {
  if (expected.size() != actual.size())
    return ::testing::AssertionFailure() << what << ": sizes differ (expected " << expected.size() << " B, got "
                                         << actual.size() << " B)";
  return bytes_equal(expected.data(), actual.data(), static_cast<int64_t>(expected.size()), what, describe);
}

}  // namespace pcpkv::test
