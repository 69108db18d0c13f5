// tools/pcpkv/error_line.h: the one form of every error the CLI prints, "pcpkv: error: <message>" on
// stderr, bounded in length (clip_middle): no input, however large, makes a multi-megabyte line.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>
#include <string_view>

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

/// Writes text to stderr (descriptor 2) and never throws. fmt::print throws when the write fails, and a closed or
/// full stderr (2>&-, 2>/dev/full) must not turn a refused input's exit code into an abort (a throw inside the
/// top-level handler ends in std::terminate, SIGABRT, 134): what cannot be written is dropped.
inline void print_stderr(std::string_view text) noexcept {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(2, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

inline void print_error(const std::string& message) noexcept {
  try {
    print_stderr(fmt::format("pcpkv: error: {}\n", clip_middle(escape_control(message))));
  } catch (...) {  // out of memory while formatting: the exit code still tells
  }
}

}  // namespace pcpkv::cli
