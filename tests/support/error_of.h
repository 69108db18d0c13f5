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

}  // namespace pcpkv::test
