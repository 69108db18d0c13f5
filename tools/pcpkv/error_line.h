// tools/pcpkv/error_line.h: the one form of every error the CLI prints, "pcpkv: error: <message>" on
// stderr, bounded in length (clip_middle): no input, however large, makes a multi-megabyte line.
#pragma once

#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "pcpkv/core/input_limits.h"

namespace pcpkv::cli {

inline void print_error(const std::string& message) {
  fmt::print(stderr, "pcpkv: error: {}\n", clip_middle(message));
}

}  // namespace pcpkv::cli
