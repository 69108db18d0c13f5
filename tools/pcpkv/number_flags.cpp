// The numeric flag checks (number_flags.h).
#include "pcpkv/number_flags.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "pcpkv/core/input_limits.h"
#include "pcpkv/error_line.h"

namespace pcpkv::cli {
namespace {

bool is_integer_option(const CLI::Option* o) {
  const std::string type = o->get_type_name();
  return type.rfind("INT", 0) == 0 || type.rfind("UINT", 0) == 0;
}

// The message for an integer option's argument that is not plain decimal ("" when it is): [+-]?digits with no
// leading zero. CLI11 reads integers with strtoll base 0, so `--tokens 064` would be 52 (octal) and `--pcp 0x8` 8,
// and it skips leading spaces (' 64' would pass, '64 ' not).
std::string non_decimal_integer(const std::string& v) {
  const size_t sign = !v.empty() && (v[0] == '-' || v[0] == '+') ? 1 : 0;
  const size_t digits = v.size() - sign;
  const bool decimal = digits > 0 && std::all_of(v.begin() + static_cast<std::ptrdiff_t>(sign), v.end(),
                                                 [](char c) { return c >= '0' && c <= '9'; });
  if (decimal && (digits == 1 || v[sign] != '0')) return "";
  const std::string q = escape_control(clip(v));
  if (decimal)
    return fmt::format("'{}' has a leading zero; integers are decimal (it would have been read as octal)", q);
  return fmt::format("'{}' is not a decimal integer (digits with an optional sign; no hex, spaces or exponent)", q);
}

// Whether the plain decimal v fits T (from_chars takes no '+').
template <class T>
bool decimal_fits(const std::string& v) {
  const size_t skip = !v.empty() && v[0] == '+' ? 1 : 0;
  T parsed{};
  const auto [end, ec] = std::from_chars(v.data() + skip, v.data() + v.size(), parsed);
  return ec == std::errc() && end == v.data() + v.size();
}

// The option converts v into its field (CLI11 runs the option's validators and conversion).
bool converts(CLI::Option* o, const std::string& v) {
  o->clear();
  o->add_result(v);
  try {
    o->run_callback();
    return true;
  } catch (...) {  // CLI::ConversionError; a check of the option's own refuses the value otherwise
    return false;
  }
}

// "--pcp" also for a hidden option (CLI11's get_name() is empty for those).
std::string flag_name(const CLI::Option* o) {
  if (!o->get_lnames().empty()) return "--" + o->get_lnames().front();
  if (!o->get_snames().empty()) return "-" + o->get_snames().front();
  return o->get_name(true);
}

}  // namespace

void check_number_flags(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    const bool integer = is_integer_option(o);
    const bool number = integer || o->get_type_name().rfind("FLOAT", 0) == 0;
    if (!number || o->get_expected_min() == 0) continue;
    o->check(CLI::Validator(
        [](std::string& v) { return std::string(v.empty() ? "an empty value is not a number, got ''" : ""); }, ""));
    if (!integer) continue;
    o->check(CLI::Validator([](std::string& v) { return v.empty() ? std::string() : non_decimal_integer(v); }, ""));
    const bool is_unsigned = o->get_type_name().rfind("UINT", 0) == 0;
    o->check(CLI::Validator(
        [o, is_unsigned](std::string& v) {
          const bool fits = is_unsigned ? decimal_fits<uint64_t>(v) : decimal_fits<int64_t>(v);
          if (!v.empty() && !fits) throw IntegerOutOfRange{o, v};
          return std::string();
        },
        ""));
  }
  for (CLI::App* sub : app.get_subcommands({})) check_number_flags(*sub);
}

std::string out_of_range_message(CLI::Option* o, const std::string& value) {
  const bool is_unsigned = o->get_type_name().rfind("UINT", 0) == 0;
  std::string lo = is_unsigned ? "0" : std::to_string(std::numeric_limits<int64_t>::min());
  std::string hi = is_unsigned ? std::to_string(std::numeric_limits<uint64_t>::max())
                               : std::to_string(std::numeric_limits<int64_t>::max());
  for (const int bits : {8, 16, 32}) {  // the narrowest width whose largest value converts and the next does not
    const uint64_t max = is_unsigned ? (uint64_t{1} << bits) - 1 : (uint64_t{1} << (bits - 1)) - 1;
    if (converts(o, std::to_string(max)) && !converts(o, std::to_string(max + 1))) {
      lo = is_unsigned ? "0" : "-" + std::to_string(max + 1);
      hi = std::to_string(max);
      break;
    }
  }
  o->clear();
  return fmt::format("{}: {} is out of range [{}, {}]", flag_name(o), escape_control(clip(value)), lo, hi);
}

std::string conversion_error_message(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    if (!is_integer_option(o) || o->results().empty()) continue;
    // The values CLI11 converted: a single-valued option's last (a repeated flag's last wins), a list's every one.
    // The one that is plain decimal yet does not convert alone is past its field's width.
    std::vector<std::string> values = o->results();
    if (o->get_expected_max() == 1) values.erase(values.begin(), values.end() - 1);
    for (const std::string& v : values)
      if (non_decimal_integer(v).empty() && !converts(o, v)) return out_of_range_message(o, v);
  }
  for (CLI::App* sub : app.get_subcommands()) {
    if (const std::string m = conversion_error_message(*sub); !m.empty()) return m;
  }
  return "";
}

}  // namespace pcpkv::cli
