// tools/pcpkv/error_line.h: the one form of every error the CLI prints, "pcpkv: error: <message>" on
// stderr, bounded in length (clip_middle): no input, however large, makes a multi-megabyte line.
#pragma once

#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "pcpkv/core/input_limits.h"

namespace pcpkv::cli {

/// s with its control characters written out (\n, \r, \t, else \xNN): a value quoted in a message (a flag's
/// argument, an environment variable) may hold a newline or a terminal escape sequence, and the error must stay
/// one line that cannot drive the terminal.
inline std::string escape_control(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += ch;
  }
  return out;
}

inline void print_error(const std::string& message) {
  fmt::print(stderr, "pcpkv: error: {}\n", clip_middle(escape_control(message)));
}

}  // namespace pcpkv::cli
