// pcpkv-test-labels: multiproc
// tests/cli/fault_loop.cpp: leaks under faults. A bounded loop of CPU multi-process
// publications in which one rank is killed with SIGKILL at a random moment (during setup, the rendezvous,
// publication or teardown): every run must exit nonzero naming the killed rank, and leave no process, no
// /dev/shm segment of its processes and no rendezvous directory behind.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/cli_runner.h"

namespace pcpkv {
namespace {

using Clock = std::chrono::steady_clock;

/// The direct children of pid (the launcher's rank processes), from /proc.
std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream f(fmt::format("/proc/{}/task/{}/children", pid, pid));
  std::vector<pid_t> out;
  for (pid_t c; f >> c;) out.push_back(c);
  return out;
}

bool process_exists(pid_t pid) {
  // A zombie still has a /proc entry; "State: Z" counts as gone (its parent reaps it).
  std::ifstream f(fmt::format("/proc/{}/status", pid));
  if (!f) return false;
  for (std::string line; std::getline(f, line);)
    if (line.rfind("State:", 0) == 0) return line.find('Z') == std::string::npos;
  return true;
}

/// /dev/shm names created by these pids (pcpkv names segments /pcpkv-<pid>-<n>-<tag>).
std::vector<std::string> shm_of(const std::set<pid_t>& pids) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string n = e.path().filename().string();
    for (pid_t p : pids)
      if (n.rfind(fmt::format("pcpkv-{}-", p), 0) == 0) out.push_back(n);
  }
  return out;
}

size_t entries(const std::string& dir) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator(dir, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec))
    ++n;
  return n;
}

TEST(FaultLoop, RandomlyKilledRankLeavesNothingBehind) {
  constexpr int kRuns = 6;           // bounded count
  constexpr double kRunLimitS = 60;  // and time per run (the fence / bootstrap timeouts are 10 s)
  std::mt19937 rng(20261201);
  test::TempDir sockets;  // the launcher's private rendezvous directories go here
  for (int run = 0; run < kRuns; ++run) {
    const int nproc = 2 + run % 3;
    const int victim = static_cast<int>(rng() % nproc);
    const int delay_ms = static_cast<int>(rng() % 1500);
    test::TempDir logdir;
    const std::string log = logdir.path + "/out.log";
    const pid_t launcher = ::fork();
    if (launcher == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
      for (const auto& [k, v] : test::clean_env()) ::unsetenv(k.c_str());
      std::vector<std::string> args{PCPKV_CLI_PATH, "launch", "--nproc", std::to_string(nproc), "--grace", "20",
                                    "--socket-dir", sockets.path, "--", "mp-publish", "--backend", "cpu",
                                    "--tokens", "512", "--repeats", "400", "--fence-timeout-ms", "10000"};
      std::vector<char*> argv;
      for (auto& s : args) argv.push_back(s.data());
      argv.push_back(nullptr);
      ::execv(PCPKV_CLI_PATH, argv.data());
      ::_exit(127);
    }
    ASSERT_GT(launcher, 0);
    // Wait for every rank process, then the random delay, then kill the victim.
    std::vector<pid_t> ranks;
    const auto t0 = Clock::now();
    while (static_cast<int>(ranks.size()) < nproc && Clock::now() - t0 < std::chrono::seconds(10)) {
      ranks = children_of(launcher);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ASSERT_EQ(static_cast<int>(ranks.size()), nproc) << "run " << run << ": the launcher did not start its ranks";
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    // children_of lists ranks in pid order, which is rank order (the launcher forks rank 0 first).
    const bool killed = ::kill(ranks[static_cast<size_t>(victim)], SIGKILL) == 0;
    int status = 0;
    bool reaped = false;
    while (Clock::now() - t0 < std::chrono::duration<double>(kRunLimitS)) {
      if (::waitpid(launcher, &status, WNOHANG) == launcher) {
        reaped = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!reaped) {
      ::kill(launcher, SIGKILL);
      ::waitpid(launcher, &status, 0);
    }
    std::ifstream f(log);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string out = ss.str();
    const std::string what = fmt::format("run {} (nproc {}, rank {} killed after {} ms):\n{}", run, nproc, victim,
                                         delay_ms, out);
    ASSERT_TRUE(reaped) << "the launcher did not exit within " << kRunLimitS << " s; " << what;
    ASSERT_TRUE(killed) << what;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << what;
    EXPECT_NE(out.find(fmt::format("pcpkv launch: rank {} (pid {}) was killed by signal 9", victim,
                                   ranks[static_cast<size_t>(victim)])),
              std::string::npos)
        << what;
    // Nothing left: no rank process, no shared-memory segment of theirs, no rendezvous directory.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (pid_t p : ranks) EXPECT_FALSE(process_exists(p)) << "rank pid " << p << " is still running; " << what;
    const std::set<pid_t> all(ranks.begin(), ranks.end());
    EXPECT_TRUE(shm_of(all).empty()) << "left in /dev/shm: " << shm_of(all).front() << "; " << what;
    EXPECT_EQ(entries(sockets.path), 0u) << "a rendezvous directory was left in " << sockets.path << "; " << what;
  }
}

}  // namespace
}  // namespace pcpkv
