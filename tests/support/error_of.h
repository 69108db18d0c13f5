// tests/support/error_of.h: the message of the pcpkv::Error a callable throws, for tests that check what an error
// names (the field, the value, the bound).
#pragma once

#include <exception>
#include <string>
#include <utility>

#include <gtest/gtest.h>

#include "pcpkv/core/error.h"

namespace pcpkv::test {

/// what() of the pcpkv::Error (FenceTimeout included) that fn() throws; "no error" when fn returns. Any other
/// exception fails the test (a bad input must be a pcpkv::Error) and its what() is returned.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const pcpkv::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a pcpkv::Error: " << e.what();
    return e.what();
  }
  return "no error";
}

/// For an error that quotes a huge value (input_limits.h clip): the message starts with `head` (the field and the
/// value's first characters), still holds `tail` (what the value should have been) and stays under max_chars.
inline void expect_clipped_error(const std::string& msg, const std::string& head, const std::string& tail,
                                 size_t max_chars = 1000) {
  EXPECT_EQ(msg.rfind(head, 0), 0u) << "expected to start with '" << head << "': " << msg.substr(0, 300);
  EXPECT_NE(msg.find(tail), std::string::npos) << "expected '" << tail << "' in: " << msg.substr(0, 300);
  EXPECT_LT(msg.size(), max_chars) << head;
}

}  // namespace pcpkv::test
