// The comma-list flags (see list_flags.h).
#include "list_flags.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <system_error>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv::cli {

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    const size_t comma = s.find(',', pos);
    out.push_back(s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::vector<std::string> split_list(const std::string& s, const char* flag) {
  PCPKV_CHECK(!s.empty(), "{}: the list is empty", flag);
  std::vector<std::string> out = split_commas(s);
  for (const std::string& item : out) PCPKV_CHECK(!item.empty(), "{}: '{}' has an empty entry", flag, clip(s));
  return out;
}

std::vector<int64_t> parse_int_list(const std::string& s, const char* flag, int64_t lo, int64_t hi,
                                    const char* none) {
  std::vector<int64_t> out;
  if (none != nullptr && s == none) return out;
  for (const std::string& item : split_list(s, flag)) {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    PCPKV_CHECK(ec == std::errc() && end == item.data() + item.size(), "{}: '{}' is not an integer (in '{}')", flag,
                clip(item), clip(s));
    if (hi == std::numeric_limits<int64_t>::max()) {
      PCPKV_CHECK(v >= lo, "{}: {} must be >= {} (in '{}')", flag, v, lo, clip(s));
    } else {
      PCPKV_CHECK(v >= lo && v <= hi, "{}: {} is not in [{}, {}] (in '{}')", flag, v, lo, hi, clip(s));
    }
    out.push_back(v);
  }
  return out;
}

std::vector<int32_t> parse_device_list(const std::string& s, const char* flag, bool given) {
  std::vector<int32_t> out;
  PCPKV_CHECK(!given || !s.empty(),
              "{}: '' is not a device list (comma-separated device indices, decimal, in [0, 1024); leave {} out for "
              "the default)",
              flag, flag);
  if (s.empty()) return out;
  for (const std::string& item : split_commas(s)) {
    // Plain decimal in [0, 1024), as every integer flag: strtol would wrap 4294967296 to device 0 and take ' 3' and
    // '01' for 3 and 1.
    int32_t d = -1;
    const bool digits =
        !item.empty() && std::all_of(item.begin(), item.end(), [](char c) { return c >= '0' && c <= '9'; });
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), d);
    PCPKV_CHECK(digits && (item.size() == 1 || item[0] != '0') && ec == std::errc() && d < 1024,
                "{}: '{}' is not a device index (decimal, in [0, 1024); in '{}')", flag, clip(item), clip(s));
    out.push_back(d);
  }
  return out;
}

}  // namespace pcpkv::cli
