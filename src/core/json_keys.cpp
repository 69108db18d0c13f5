// The duplicate-key scan of JSON text (json_keys.h).
#include "core/json_keys.h"

#include <set>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace pcpkv {
namespace {

struct Scan final : nlohmann::json_sax<nlohmann::json> {
  struct Level {
    bool object;
    std::set<std::string> keys;  // the keys seen so far (objects)
    std::string key;             // the current key (objects)
    size_t index = 0;            // the current element (arrays)
  };
  std::vector<Level> open;
  std::optional<DuplicateKey> first;

  bool null() override { return value_done(); }
  bool boolean(bool) override { return value_done(); }
  bool number_integer(number_integer_t) override { return value_done(); }
  bool number_unsigned(number_unsigned_t) override { return value_done(); }
  bool number_float(number_float_t, const string_t&) override { return value_done(); }
  bool string(string_t&) override { return value_done(); }
  bool binary(binary_t&) override { return value_done(); }
  bool start_object(std::size_t) override {
    open.push_back({true, {}, {}, 0});
    return true;
  }
  bool start_array(std::size_t) override {
    open.push_back({false, {}, {}, 0});
    return true;
  }
  bool end_object() override { return end(); }
  bool end_array() override { return end(); }
  bool key(string_t& k) override {
    Level& l = open.back();
    l.key = k;
    if (l.keys.insert(k).second) return true;
    first = DuplicateKey{k, path(), open.size()};
    return false;  // the first one is the one named: stop here
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  bool end() {
    open.pop_back();
    return value_done();
  }
  bool value_done() {
    if (!open.empty() && !open.back().object) ++open.back().index;
    return true;
  }
  std::string path() const {
    std::string p;
    for (const Level& l : open) p += l.object ? (p.empty() ? "" : ".") + l.key : fmt::format("[{}]", l.index);
    return p;
  }
};

}  // namespace

std::optional<DuplicateKey> first_duplicate_key(const std::string& text) {
  Scan scan;
  nlohmann::json::sax_parse(text, &scan, nlohmann::json::input_format_t::json, /*strict=*/true);
  return scan.first;
}

}  // namespace pcpkv
