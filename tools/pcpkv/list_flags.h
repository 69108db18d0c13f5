// The comma-list flags of the CLI (--pcp 2,4,8, --models, --transport, --gpus ...), split and parsed in one place;
// each throws pcpkv::Error naming the flag, the bad entry and the whole value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pcpkv::cli {

/// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}: every entry as typed, empty ones included, for parsers that name a
/// bad entry in their own words (parse_transport_list, parse_device_list).
std::vector<std::string> split_commas(const std::string& s);

/// "2,4,8" -> {"2", "4", "8"}. An empty entry ("2,,3", "2,", ",2") is refused, not dropped: a dropped entry would
/// quietly run fewer cases than asked. An empty list is refused too.
std::vector<std::string> split_list(const std::string& s, const char* flag);

/// A comma list of integers in [lo, hi] (hi = INT64_MAX: no upper bound, and the message says ">= lo"); the message
/// names the flag, the entry and the whole value. `none`, when given, is the value that means the empty list ("none"
/// for --single-rank-tokens, "" for --prefill); otherwise an empty list is refused as by split_list.
std::vector<int64_t> parse_int_list(const std::string& s, const char* flag, int64_t lo, int64_t hi,
                                    const char* none = nullptr);

/// "0,1,3" -> {0, 1, 3}; "" -> {} (the flag left out: the default devices). Each entry a plain decimal device index in
/// [0, 1024). `given`: the flag was on the command line, so '' (an unset shell variable) is refused, not read as "left
/// out", which would run on the default devices without a word.
std::vector<int32_t> parse_device_list(const std::string& s, const char* flag, bool given = false);

}  // namespace pcpkv::cli
