// pcpkv-test-labels: unit
// Issue 31 item 5: a refused input aborted with SIGABRT (exit 134) when stderr was closed (2>&-) or full
// (2>/dev/full): printing the error threw inside the top-level handler. The documented exit code must come out
// whatever happens to stderr.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "support/cli_util.h"

using pcpkv_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

// The exit code of `pcpkv <args>` with stderr redirected by `redirect` (stdout to a file of `dir`).
int exit_code_with(const std::string& args, const std::string& redirect, const ScratchDir& dir) {
  const std::string cmd =
      std::string("'") + PCPKV_CLI_PATH + "' " + args + " >'" + dir.file("out") + "' " + redirect;
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct Case {
  std::string args;
  int code;  // the documented exit code (the one a working stderr gives)
};

const std::vector<Case> kCases = {
    {"run --pcp 0", 2},
    {"rnu", 2},                                // an unknown command
    {"", 2},                                   // no command
    {"run --tokens 064", 2},                   // a CLI11 validator's refusal
    {"launch --nproc 2 -- run", 2},            // not a rank program
    {"launch --nproc 0 -- mp-publish", 2},
    {"attention --pcp 0", 2},
    {"mp-publish --backend bogus", 2},
};

TEST(CliStderrLost, RefusalsKeepTheirExitCode) {
  ScratchDir dir;
  for (const Case& c : kCases) {
    ASSERT_EQ(exit_code_with(c.args, "2>'" + dir.file("err") + "'", dir), c.code) << c.args << " (stderr to a file)";
    EXPECT_EQ(exit_code_with(c.args, "2>&-", dir), c.code) << c.args << " (stderr closed)";
    if (fs::exists("/dev/full")) {
      EXPECT_EQ(exit_code_with(c.args, "2>/dev/full", dir), c.code) << c.args << " (stderr full)";
    }
  }
}

}  // namespace
