// pcpkv-test-labels: unit
// The rules every integer flag of every command follows (tools/pcpkv/number_flags.h) and the one repeated-flag
// rule (main.cpp): a value past the flag's field is refused naming the flag, the value as typed and the field's
// range, and a flag given twice takes its last value in every command.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;

namespace {

constexpr const char* kInt32 = "is out of range [-2147483648, 2147483647]";
constexpr const char* kInt64 = "is out of range [-9223372036854775808, 9223372036854775807]";
constexpr const char* kUint64 = "is out of range [0, 18446744073709551615]";

// CLI11 said "Could not convert: --pcp = 99999999999999999999" for an int32 past its width, and clamped an int64
// past 64 bits to INT64_MAX ('--guard-bytes 99999999999999999999' was refused as 9223372036854775807) or took
// '+99999999999999999999' as it; every command's integer flags now name the flag, the value and the range.
TEST(CliNumberFlags, IntegersPastTheirFieldNameTheFlagTheValueAndTheRange) {
  struct Case {
    std::string args, expect;
  };
  const std::string big = "99999999999999999999";
  const std::vector<Case> cases = {
      {"run --pcp " + big + " --tokens 64", "--pcp: " + big + " " + kInt32},
      {"run --block-size 4294967296", "--block-size: 4294967296 " + std::string(kInt32)},
      {"run --threads=-2147483649", "--threads: -2147483649 " + std::string(kInt32)},
      {"run --tokens +" + big, "--tokens: +" + big + " " + kInt64},
      {"run --seed=-1", "--seed: -1 " + std::string(kUint64)},
      {"run --pcp 2 --pcp " + big, "--pcp: " + big + " " + kInt32},  // the last value is the one converted
      {"mp-publish --backend cpu --guard-bytes " + big, "--guard-bytes: " + big + " " + kInt64},
      {"mp-publish --backend cpu --tp 4294967296", "--tp: 4294967296 " + std::string(kInt32)},
      {"launch --nproc 4294967296 -- mp-publish", "--nproc: 4294967296 " + std::string(kInt32)},
      {"bench-fence --iters 2147483648", "--iters: 2147483648 " + std::string(kInt32)},
      {"attention --prefill-context=-" + big, "--prefill-context: -" + big + " " + kInt64},
  };
  for (const Case& c : cases) {
    ScratchDir dir;
    const CliResult r = run_cli(c.args, dir);
    pcpkv_test::expect_refusal(r, c.args, {"pcpkv: error: " + c.expect}, dir);
    EXPECT_EQ(r.err.find("Could not convert"), std::string::npos) << c.args << "\n" << r.err;
  }
}

// run took a repeated flag's last value (docs/cli.md) while launch and mp-publish refused it with CLI11's "At Most
// 1 required but received 2": every command takes the last now.
TEST(CliNumberFlags, ARepeatedFlagTakesItsLastValueInEveryCommand) {
  ScratchDir dir;
  CliResult r = run_cli("launch --nproc 3 --nproc 2 --program /bin/sh -- -c 'test \"$PCPKV_WORLD_SIZE\" = 2'", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = run_cli("mp-publish --backend cpu --transport staging --transport direct --tokens 64 --tokens 32 --decodes 0",
              dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("32 tokens over 1 ranks"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("staging"), std::string::npos) << r.out;
  r = run_cli("bench-fence --backend cpu --iters 5 --iters 0", dir);  // the last, 0, is refused
  pcpkv_test::expect_refusal(r, "bench-fence", {"--iters: must be in [1, 1000000], got 0"}, dir);
  r = run_cli(std::string("run --backend cpu --transport direct ") + pcpkv_test::kSmallRunFlags +
                  " --tokens 64 --decodes 0 --pcp 3 --pcp 2 --json",
              dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(pcpkv_test::parse_json(r.out).at("plan").at("pcp_world").get<int>(), 2) << r.out;
}

}  // namespace
