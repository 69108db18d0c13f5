// tools/pcpkv/error_line.h: the one form of every error the CLI prints, "pcpkv: error: <message>" on
// stderr, bounded in length (clip_middle): no input, however large, makes a multi-megabyte line.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "pcpkv/core/input_limits.h"

namespace pcpkv::cli {

// Bytes of the well-formed UTF-8 sequence at s[i] (1 to 4), or 0 when s[i] does not start one: a stray continuation
// byte, an overlong form, a surrogate, past U+10FFFF, or cut short. Unicode's table 3-7 of well-formed sequences.
inline size_t utf8_sequence_bytes(const std::string& s, size_t i) {
  const auto at = [&](size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0u; };
  const unsigned c = at(0);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned lo = 0x80, hi = 0xbf;  // the second byte's range
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) n = 3, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
  else if (c >= 0xf0 && c <= 0xf4) n = 4, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
  else return 0;
  if (at(1) < lo || at(1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (at(k) < 0x80 || at(k) > 0xbf) return 0;
  return n;
}

/// s with its control characters written out (\n, \r, \t, else \xNN), and so every byte that is not UTF-8 text (a
/// binary --config's 0xff, which nlohmann quotes as "last read: '...'") and the C1 controls U+0080-U+009F: a value
/// quoted in a message (a flag's argument, an environment variable, a file's bytes) may hold a newline or a terminal
/// escape sequence, and the error must stay one line of text that cannot drive the terminal. Other UTF-8 passes.
inline std::string escape_control(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = utf8_sequence_bytes(s, i);
    const bool c1 = n == 2 && c == 0xc2 && static_cast<unsigned char>(s[i + 1]) < 0xa0;
    if (n > 1 && !c1) {
      out.append(s, i, n);
      i += n;
      continue;
    }
    for (size_t k = 0; k < std::max<size_t>(n, 1); ++k, ++i) {
      const auto b = static_cast<unsigned char>(s[i]);
      if (b == '\n') out += "\\n";
      else if (b == '\r') out += "\\r";
      else if (b == '\t') out += "\\t";
      else if (b < 0x20 || b >= 0x7f) out += fmt::format("\\x{:02x}", b);
      else out += static_cast<char>(b);
    }
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
    // Escaped again after the cut: clip_middle may split a UTF-8 character, whose bytes then read as \xNN.
    print_stderr(fmt::format("pcpkv: error: {}\n", escape_control(clip_middle(escape_control(message)))));
  } catch (...) {  // out of memory while formatting: the exit code still tells
  }
}

}  // namespace pcpkv::cli
