// tools/pcpkv/number_flags.h: the rules every numeric flag of every command follows, attached in one place
// (main.cpp) rather than flag by flag: a number is never empty, an integer is plain decimal, and an integer past
// what its field holds is refused naming the flag, the value as typed and the field's range.
#pragma once

#include <string>

namespace CLI {
class App;
class ConversionError;
class Option;
}  // namespace CLI

namespace pcpkv::cli {

/// Attaches the checks to every option of app and its subcommands whose type is a number: CLI11 reads '' as 0,
/// reads integers with strtoll base 0 ('064' is octal 52, '0x40' passes) and clamps a decimal past 64 bits to
/// INT64_MAX (or wraps '-1' into a uint64) without a word.
void check_number_flags(CLI::App& app);

/// Thrown, from inside CLI11's parse, by the check of a decimal that no 64-bit field holds; run_app names it
/// with out_of_range_message once the parse has stopped (the field's own range is known only then).
struct IntegerOutOfRange {
  CLI::Option* option;
  std::string value;
};

/// "--pcp: 99999999999999999999 is out of range [-2147483648, 2147483647]": the range of the integer field behind
/// `option`, found by converting its bounds with the option itself (CLI11 does not say the field's width). Only
/// once the parse has failed: it overwrites the option's field.
std::string out_of_range_message(CLI::Option* option, const std::string& value);

/// The same message for CLI11's ConversionError of a decimal that fits 64 bits but not the field ('--block-size
/// 4294967296', an int32), found among the options of the commands `app` parsed; "" when it is not that case.
std::string conversion_error_message(CLI::App& app);

}  // namespace pcpkv::cli
