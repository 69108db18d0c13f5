// The HF config.json value reader (see hf_json.h).
#include "core/hf_json.h"

namespace pcpkv::hf_json {

JsonPaths scan_json(const std::string& text) {
  JsonPaths paths;
  json::sax_parse(text, &paths, json::input_format_t::json, /*strict=*/true);  // reports through parse_error
  return paths;
}

std::string as_written(const json& v, const JsonPaths* paths, const std::string& path) {
  if (v.is_number() && paths) {
    const auto it = paths->raw_numbers.find(path);
    if (it != paths->raw_numbers.end()) return clip(it->second);
  }
  return clip(v.dump());
}

std::string with_type(const std::string& written, const json& v) {
  if (v.is_null()) return "null";
  const std::string t = v.type_name();
  const bool vowel = t[0] == 'a' || t[0] == 'o';
  return fmt::format("{} ({} {})", written, vowel ? "an" : "a", t);  // callers clip `written`
}

[[noreturn]] void fail_unparsable(const std::string& text, const std::string& origin, const json::exception& e) {
  const JsonPaths paths = scan_json(text);
  const std::string at = paths.error_path.empty() ? std::string() : fmt::format(" at '{}'", paths.error_path);
  if (e.id == 406) {
    PCPKV_FAIL("{}: '{}' = {} is out of range for a JSON number (it overflows a double)", origin,
               paths.error_path.empty() ? "(top level)" : clip(paths.error_path), clip(paths.error_token));
  }
  PCPKV_FAIL("{}: not valid JSON{}: {}", origin, clip(at), clip(e.what()));
}

}  // namespace pcpkv::hf_json
