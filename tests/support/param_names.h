// tests/support/param_names.h: names of value-parameterized test cases. ctest names a discovered test by its
// GoogleTest name alone (tests/CMakeLists.txt: NO_PRETTY_VALUES), so every INSTANTIATE_TEST_SUITE_P passes a name
// generator: readable, stable between runs (GoogleTest prints a struct without PrintTo as its bytes, padding
// included, which changed the names from run to run) and within GoogleTest's [A-Za-z0-9_].
#pragma once

#include <cstdio>
#include <string>

#include "pcpkv/core/layout.h"

namespace pcpkv::test {

/// `s` with every character outside [A-Za-z0-9_] replaced by '_'.
inline std::string gtest_name(std::string s) {
  for (char& ch : s)
    if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9'))) ch = '_';
  return s;
}

/// A cache format case: "fp8_ds_mla_pow2_indexer_k1", "fp8_pow2_k0_0123" (k_scale as printf's %g spells it).
inline std::string format_case_name(KvFormat kv, DsMlaScale scale, bool indexer, float k_scale) {
  char k[32];
  std::snprintf(k, sizeof k, "%g", static_cast<double>(k_scale));
  return gtest_name(std::string(to_string(kv)) + "_" + to_string(scale) + (indexer ? "_indexer" : "") + "_k" + k);
}

}  // namespace pcpkv::test
