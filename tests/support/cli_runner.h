// tests/support/cli_runner.h: run the pcpkv CLI (PCPKV_CLI_PATH) as a child process with extra
// environment variables and a time limit; collect its exit status, output and wall time.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "support/fork_ranks.h"

namespace pcpkv::test {

struct CliResult {
  int exit_code = -1;   // -1: killed by a signal
  int signal = 0;
  bool timed_out = false;
  std::string output;   // stdout and stderr, interleaved
  double seconds = 0;
};

/// Spawns `program args...` (program defaults to the pcpkv CLI) and waits at most limit_s seconds.
/// env: variables to set (or, with an empty value, to unset) in the child.
inline CliResult run_program(const std::vector<std::string>& args, double limit_s = 120,
                             const std::vector<std::pair<std::string, std::string>>& env = {},
                             const std::string& program = PCPKV_CLI_PATH) {
  TempDir dir;
  const std::string log = dir.path + "/out.log";
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::close(fd);
    for (const auto& [k, v] : env) {
      if (v.empty())
        ::unsetenv(k.c_str());
      else
        ::setenv(k.c_str(), v.c_str(), 1);
    }
    std::vector<std::string> all{program};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : all) argv.push_back(s.data());
    argv.push_back(nullptr);
    ::execv(program.c_str(), argv.data());
    ::_exit(127);
  }
  CliResult r;
  int status = 0;
  for (;;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) break;
    if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(limit_s)) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  r.output = ss.str();
  return r;
}

/// One line for a failed expectation: how the program ended, then its output.
inline std::string describe(const CliResult& r) {
  return fmt::format("exit {} signal {}{} after {:.1f} s; output:\n{}", r.exit_code, r.signal,
                     r.timed_out ? " (timed out)" : "", r.seconds, r.output);
}

inline int count_occurrences(const std::string& hay, const std::string& needle) {
  int n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

// Variables a test run of the CLI must not inherit from whatever launched the tests.
inline std::vector<std::pair<std::string, std::string>> clean_env() {
  return {{"PCPKV_RANK", ""},  {"PCPKV_WORLD_SIZE", ""}, {"PCPKV_LOCAL_RANK", ""}, {"PCPKV_LOCAL_WORLD_SIZE", ""},
          {"PCPKV_BOOTSTRAP", ""}, {"PCPKV_JOB_TOKEN", ""}, {"RANK", ""},      {"WORLD_SIZE", ""},
          {"LOCAL_RANK", ""},  {"MASTER_ADDR", ""},      {"MASTER_PORT", ""},   {"PCPKV_DEVICE", ""},
          {"LOCAL_WORLD_SIZE", ""}, {"TORCHELASTIC_RUN_ID", ""}, {"PCPKV_JOB_ID", ""}};
}

// A MASTER_PORT for a torchrun-style test job: random in [20000, 60000), so tests run side by side rarely meet.
inline std::string random_port() {
  std::mt19937 rng(std::random_device{}());
  return std::to_string(20000 + rng() % 40000);
}

// clean_env() plus what torchrun gives rank `rank` of `world` on this host (RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT), with the bootstrap's socket folder `dir` (a test's own, so no other job's socket is seen).
inline std::vector<std::pair<std::string, std::string>> torchrun_env(int rank, int world, const std::string& port,
                                                                     const std::string& dir) {
  auto env = clean_env();
  env.push_back({"RANK", std::to_string(rank)});
  env.push_back({"WORLD_SIZE", std::to_string(world)});
  env.push_back({"MASTER_ADDR", "127.0.0.1"});
  env.push_back({"MASTER_PORT", port});
  env.push_back({"PCPKV_BOOTSTRAP_DIR", dir});
  return env;
}

}  // namespace pcpkv::test
