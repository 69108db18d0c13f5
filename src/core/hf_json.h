// Reading an HF config.json's values with messages that quote them as the file spells them and name their key
// path: the number scanner (JsonPaths), the typed reader (Reader) and the message of an unparsable text.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv::hf_json {

using nlohmann::json;

// Where each number of a JSON text sits and how it was written: a second, DOM-free pass over the text
// (nlohmann's SAX interface) so messages can quote a value as the file spells it ("1e30", not "1e+30")
// and name the key at which parsing failed (number overflow, a syntax error).
class JsonPaths final : public nlohmann::json_sax<json> {
 public:
  std::map<std::string, std::string> raw_numbers;  // "rope_scaling.factor" -> "40"
  std::string error_path;                          // key path where the parse failed ("" = top level)
  std::string error_token;                         // the token at the failure

  bool null() override { return value_done(); }
  bool boolean(bool) override { return value_done(); }
  bool number_integer(number_integer_t v) override { return number(std::to_string(v)); }
  bool number_unsigned(number_unsigned_t v) override { return number(std::to_string(v)); }
  bool number_float(number_float_t, const string_t& s) override { return number(s); }
  bool string(string_t&) override { return value_done(); }
  bool binary(binary_t&) override { return value_done(); }
  bool start_object(std::size_t) override {
    stack_.push_back({true, {}, 0});
    return true;
  }
  bool key(string_t& k) override {
    stack_.back().key = k;
    return true;
  }
  bool end_object() override {
    stack_.pop_back();
    return value_done();
  }
  bool start_array(std::size_t) override {
    stack_.push_back({false, {}, 0});
    return true;
  }
  bool end_array() override {
    stack_.pop_back();
    return value_done();
  }
  bool parse_error(std::size_t, const std::string& token, const nlohmann::detail::exception&) override {
    error_path = path();
    error_token = token;
    return false;
  }

  /// "rope_scaling.factor", "indexer_types[3]"; "" at the top level.
  std::string path() const {
    std::string p;
    for (const Level& l : stack_) {
      if (l.object) {
        if (!l.key.empty()) p += (p.empty() ? "" : ".") + l.key;
      } else {
        p += fmt::format("[{}]", l.index);
      }
    }
    return p;
  }

 private:
  struct Level {
    bool object;
    std::string key;
    size_t index;
  };
  bool number(const std::string& text) {
    raw_numbers[path()] = text;
    return value_done();
  }
  bool value_done() {
    if (!stack_.empty() && !stack_.back().object) ++stack_.back().index;
    return true;
  }
  std::vector<Level> stack_;
};


/// The numbers and the failure point of `text` (JsonPaths); never throws for bad JSON.
JsonPaths scan_json(const std::string& text);

/// How a value is written in the file: numbers as the text spells them, the rest as JSON (clipped).
std::string as_written(const json& v, const JsonPaths* paths, const std::string& path);

/// "5 (a number)", "null", "\"x\" (a string)"; callers clip `written`.
std::string with_type(const std::string& written, const json& v);

/// A pcpkv::Error for a JSON text nlohmann refused, naming the key where parsing stopped when there is one
/// (a number too large for a double throws out_of_range 406, not parse_error).
[[noreturn]] void fail_unparsable(const std::string& text, const std::string& origin, const json::exception& e);

/// Typed reads of one object's keys: a wrong type, a non-integer or an out-of-range value throws pcpkv::Error naming
/// origin, the key and the value as written.
class Reader {
 public:
  // prefix: the key path of the object read ("" top level, "rope_scaling"); origin names it in messages.
  Reader(const json& j, std::string origin, const JsonPaths* paths = nullptr, std::string prefix = {})
      : j_(j), origin_(std::move(origin)), paths_(paths), prefix_(std::move(prefix)) {}

  template <typename T>
  bool read(const char* key, T& out, const json* obj = nullptr) {
    const json& o = obj ? *obj : j_;
    if (!o.contains(key) || o.at(key).is_null()) return false;
    const json& v = o.at(key);
    const std::string written = as_written(v, paths_, prefix_.empty() ? key : prefix_ + "." + key);
    try {
      if constexpr (std::is_same_v<T, bool>) {
        PCPKV_CHECK(v.is_boolean(), "{}: '{}' must be a boolean, got {}", origin_, key, with_type(written, v));
        out = v.get<bool>();
      } else if constexpr (std::is_integral_v<T>) {
        // The range is checked before any conversion: 1e30 or 2^64 - 2048 must not wrap into a small or
        // negative value that passes the later checks.
        constexpr auto lo = std::numeric_limits<T>::min();
        constexpr auto hi = std::numeric_limits<T>::max();
        PCPKV_CHECK(v.is_number(), "{}: '{}' must be an integer, got {}", origin_, key, with_type(written, v));
        // long double holds every int64 and uint64 exactly (64-bit mantissa), and any double.
        long double value = 0;
        if (v.is_number_unsigned()) {
          value = static_cast<long double>(v.get<uint64_t>());
        } else if (v.is_number_integer()) {
          value = static_cast<long double>(v.get<int64_t>());
        } else {
          const double d = v.get<double>();
          PCPKV_CHECK(std::isfinite(d) && std::floor(d) == d, "{}: '{}' must be an integer, got {}", origin_, key,
                      written);
          value = d;
        }
        const bool in_range = value >= static_cast<long double>(lo) && value <= static_cast<long double>(hi);
        PCPKV_CHECK(in_range, "{}: '{}' = {} is out of range [{}, {}]", origin_, key, written, lo, hi);
        out = static_cast<T>(value);
      } else if constexpr (std::is_floating_point_v<T>) {
        PCPKV_CHECK(v.is_number(), "{}: '{}' must be a number, got {}", origin_, key, with_type(written, v));
        out = v.get<double>();
      } else {
        PCPKV_CHECK(v.is_string(), "{}: '{}' must be a string, got {}", origin_, key, with_type(written, v));
        out = v.get<std::string>();
      }
    } catch (const json::exception& e) {
      PCPKV_FAIL("{}: '{}' has an unusable value {}: {}", origin_, key, written, clip(e.what()));
    }
    return true;
  }

 private:
  const json& j_;
  std::string origin_;
  const JsonPaths* paths_;
  std::string prefix_;
};

}  // namespace pcpkv::hf_json
