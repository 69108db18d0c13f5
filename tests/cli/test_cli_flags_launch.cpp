// pcpkv-test-labels: unit
// Flags of the launched subcommands (`mp-publish`, `bench-fence`) that make no sense are refused before anything is
// allocated: exit code 2, "pcpkv: error: --flag: ..." naming the flag and the value (under `pcpkv launch` every
// rank names every rank's refusal right after the rendezvous), nothing on stdout and nothing left in the
// launcher's socket directory.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;

namespace {

// Checks a refusal: exit 2, every string of `expect` in stderr, stdout empty, the directory empty (rank
// lines are prefixed, so "pcpkv: error: " need not come first).
void expect_refused(const CliResult& r, const std::string& args, const std::vector<std::string>& expect,
                    const ScratchDir& dir) {
  pcpkv_test::expect_refusal(r, args, expect, dir, {}, /*error_first=*/false);
}

// `pcpkv <cmd> <args>` as one process (a world of one: the flags are checked before any rendezvous).
void expect_refused_alone(const std::string& cmd, const std::string& args, const std::vector<std::string>& expect) {
  ScratchDir dir;
  expect_refused(run_cli(cmd + " --backend cpu " + args, dir), cmd + " " + args, expect, dir);
}

// `pcpkv launch --nproc 2 -- <cmd> <args>`: both ranks refuse; --max-time bounds a run that was not refused.
void expect_refused_launched(const std::string& cmd, const std::string& args, const std::vector<std::string>& expect) {
  ScratchDir dir;
  const std::string line = "launch --nproc 2 --max-time 120 --socket-dir '" + dir.file("") + "' -- " + cmd +
                           " --backend cpu " + args;
  const CliResult r = run_cli(line, dir);
  expect_refused(r, line, expect, dir);
  for (const char* rank : {"[rank 0] pcpkv: error: ", "[rank 1] pcpkv: error: "})
    EXPECT_NE(r.err.find(rank), std::string::npos) << line << ": missing '" << rank << "' in\n" << r.err;
}

TEST(CliFlagsLaunch, MpPublishThreadsCapped) {
  expect_refused_launched("mp-publish", "--threads 100000", {"--threads", "100000", "1024"});
  expect_refused_alone("mp-publish", "--threads 100000", {"--threads", "100000", "1024"});
  expect_refused_alone("mp-publish", "--threads 0", {"--threads", "0"});
  expect_refused_alone("mp-publish", "--threads=-4", {"--threads", "-4"});
}

TEST(CliFlagsLaunch, MpPublishCountsMustMakeSense) {
  expect_refused_launched("mp-publish", "--tokens=-5", {"--tokens", "-5"});
  expect_refused_alone("mp-publish", "--decodes=-2", {"--decodes", "-2"});
  expect_refused_alone("mp-publish", "--repeats 0", {"--repeats", "0"});
  expect_refused_alone("mp-publish", "--repeats=-3", {"--repeats", "-3"});
  expect_refused_alone("mp-publish", "--warmup=-1", {"--warmup", "-1"});
  expect_refused_alone("mp-publish", "--graph-replays=-1", {"--graph-replays", "-1"});
  expect_refused_alone("mp-publish", "--topk-width=-8", {"--topk-width", "-8"});
  expect_refused_alone("mp-publish", "--tp 0", {"--tp", "0"});
  expect_refused_alone("mp-publish", "--kill-rank=-2", {"--kill-rank", "-2"});
  expect_refused_alone("mp-publish", "--tokens 0 --decodes 0", {"--tokens 0 --decodes 0", "empty"});
}

TEST(CliFlagsLaunch, MpPublishBlockSizeAndLayout) {
  expect_refused_launched("mp-publish", "--block-size 48", {"--block-size", "48", "power of two"});
  expect_refused_alone("mp-publish", "--block-size 0", {"--block-size", "0", "power of two"});
  expect_refused_alone("mp-publish", "--block-size=-64", {"--block-size", "-64"});
  expect_refused_alone("mp-publish", "--block-size 2", {"--block-size", "2", "multiple of 16"});
  expect_refused_alone("mp-publish", "--guard-bytes=-16", {"--guard-bytes", "-16"});
  expect_refused_alone("mp-publish", "--base-offset 8", {"--base-offset", "8", "multiple of 16"});
}

TEST(CliFlagsLaunch, MpPublishScalesAndNames) {
  expect_refused_alone("mp-publish", "--fence-timeout-ms 0", {"--fence-timeout-ms", "0"});
  expect_refused_alone("mp-publish", "--fence-timeout-ms=-1", {"--fence-timeout-ms", "-1"});
  expect_refused_alone("mp-publish", "--k-scale 0", {"--k-scale", "0"});
  expect_refused_alone("mp-publish", "--k-scale nan", {"--k-scale", "nan"});
  expect_refused_alone("mp-publish", "--k-scale 1e-45", {"--k-scale", "1e-45", "normal float32"});  // subnormal
  expect_refused_alone("mp-publish", "--flush-l2-mb=-1", {"--flush-l2-mb", "-1"});
  expect_refused_alone("mp-publish", "--link-gbps inf", {"--link-gbps", "inf"});
  expect_refused_alone("mp-publish", "--collect-via shm", {"--collect-via", "shm"});
  expect_refused_alone("mp-publish", "--kv-format fp4", {"kv-format", "fp4"});
  expect_refused_alone("mp-publish", "--transport collect,nvls", {"--transport", "nvls"});
  expect_refused_alone("mp-publish", "--model llama-3", {"--model", "llama-3"});
}

// mp-publish has no --pcp: the world comes from the launcher. pcpkv's own message names the flag and the
// value instead of CLI11's "The following arguments were not expected: 0 --pcp".
TEST(CliFlagsLaunch, MpPublishPcpPointsToLaunch) {
  for (const char* v : {"0", "99999999999", "4"}) {
    expect_refused_alone("mp-publish", std::string("--pcp ") + v,
                         {std::string("--pcp ") + v, "no --pcp flag", "launch --nproc"});
  }
  expect_refused_alone("mp-publish", "--pcp=-3", {"--pcp -3", "no --pcp flag"});
  expect_refused_launched("mp-publish", "--pcp 2", {"--pcp 2", "no --pcp flag", "launch --nproc"});
}

// `launch` starts rank programs only: a nested launch or a one-process subcommand is refused before any
// rank starts, listing the rank programs.
TEST(CliFlagsLaunch, OnlyRankProgramsAreLaunched) {
  for (const char* cmd : {"launch --nproc 2 -- mp-publish", "run", "info", "attention", "bench-link"}) {
    ScratchDir dir;
    const std::string line = "launch --nproc 2 --socket-dir '" + dir.file("") + "' -- " + cmd;
    const CliResult r = run_cli(line, dir);
    expect_refused(r, line, {"mp-publish, bench-fence, bench-allreduce"}, dir);
    EXPECT_EQ(r.err.find("[rank "), std::string::npos) << line << ": a rank started:\n" << r.err;
  }
  ScratchDir dir;
  CliResult r = run_cli("launch --nproc 2 -- launch --nproc 2 -- mp-publish", dir);
  EXPECT_NE(r.err.find("nested launch"), std::string::npos) << r.err;
  r = run_cli("launch --nproc 3 -- run --pcp 2", dir);
  EXPECT_NE(r.err.find("'run' is not a rank program"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--nproc 3"), std::string::npos) << r.err;
  // --program names another executable: not pcpkv's to judge.
  r = run_cli("launch --nproc 2 --program /bin/sh -- -c 'exit 0'", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(CliFlagsLaunch, BenchFenceTimeoutMustBePositive) {
  expect_refused_launched("bench-fence", "--timeout-ms 0", {"--timeout-ms", "0"});
  expect_refused_launched("bench-fence", "--timeout-ms=-5", {"--timeout-ms", "-5"});
  expect_refused_alone("bench-fence", "--timeout-ms 0", {"--timeout-ms", "0"});
  // Far past a day is a typo, and near INT64_MAX the deadline would overflow into the past.
  expect_refused_alone("bench-fence", "--timeout-ms 9223372036854775807", {"--timeout-ms", "9223372036854775807"});
}

TEST(CliFlagsLaunch, BenchFenceCountsMustMakeSense) {
  expect_refused_alone("bench-fence", "--layers 0", {"--layers", "0"});
  expect_refused_alone("bench-fence", "--iters 0", {"--iters", "0"});
  expect_refused_alone("bench-fence", "--warmup=-1", {"--warmup", "-1"});
  expect_refused_alone("bench-fence", "--barriers 0", {"--barriers", "0"});
  expect_refused_alone("bench-fence", "--barriers 100000", {"--barriers", "100000"});
  expect_refused_alone("bench-fence", "--time-budget=-1", {"--time-budget", "-1"});
}

}  // namespace

// --gpus went through strtol into an int32: 4294967296 became device 0 without a word, 2147483648 a negative one,
// and ' 3' or '01' passed while every other integer flag is plain decimal.
TEST(CliFlagsLaunch, GpuListIsPlainDecimalDeviceIndices) {
  for (const char* bad : {"4294967296", "2147483648", "99999999999999999999", "01", "+0", "1024", "0,-1"}) {
    ScratchDir dir;
    const CliResult r =
        run_cli(std::string("launch --nproc 1 --gpus '") + bad + "' --program /bin/true -- x", dir);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("is not a device index (decimal, in [0, 1024)"), std::string::npos) << bad << ": " << r.err;
  }
}

// --gpus '' (an unset shell variable) read as "not given": the job ran on the default devices, exit 0, no note.
TEST(CliFlagsLaunch, AnEmptyGpuListIsRefused) {
  for (const char* cmd : {"launch --nproc 1 --gpus '' --program /bin/true -- x", "bench-link --gpus ''"}) {
    ScratchDir dir;
    const CliResult r = run_cli(cmd, dir);
    EXPECT_EQ(r.exit_code, 2) << cmd << ": " << r.err;
    EXPECT_NE(r.err.find("--gpus: '' is not a device list"), std::string::npos) << cmd << ": " << r.err;
  }
}

// --max-time nan and -1 were accepted and meant no limit; only 0 says that.
TEST(CliFlagsLaunch, MaxTimeNanOrNegativeIsRefused) {
  for (const char* bad : {"nan", "-1", "-inf"}) {
    ScratchDir dir;
    const CliResult r = run_cli(std::string("launch --nproc 1 --max-time ") + bad + " --program /bin/true -- x", dir);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("--max-time must be >= 0 seconds (0: no limit), got"), std::string::npos) << bad << ": "
                                                                                                 << r.err;
  }
}
