// tests/support/bytes.h: byte-for-byte comparison of raw buffers (a kernel's output against the oracle's) with a
// readable first difference, counted by pcpkv::compare_bytes. Publications (PublishResult): publish_case.h.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace pcpkv::test {

/// Describes a byte offset for messages, e.g. "slot 17, kv_c tile 2 byte 5".
using OffsetDescriber = std::function<std::string(int64_t offset)>;

/// Success when the n bytes at expected and actual are equal; otherwise:
/// "<what>: 12 of 65536 bytes differ; first at byte 1234 (<describe(1234)>): expected 0x3c, got 0x3d".
::testing::AssertionResult bytes_equal(const void* expected, const void* actual, int64_t n, const std::string& what,
                                       const OffsetDescriber& describe = {});
::testing::AssertionResult bytes_equal(const std::vector<uint8_t>& expected, const std::vector<uint8_t>& actual,
                                       const std::string& what, const OffsetDescriber& describe = {});

}  // namespace pcpkv::test
