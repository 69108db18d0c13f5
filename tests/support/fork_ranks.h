// tests/support/fork_ranks.h: run a test body in N forked rank processes (CPU only; GPU tests spawn the
// CLI instead, because a process must not fork after touching CUDA).
//
// Each child gets a BootstrapConfig for a fresh private socket directory and job token, runs the body,
// and exits with its return value (a pcpkv::Error or other exception: prints it, exit 3). Its stdout and
// stderr go to a file the parent reads back, so tests can check the messages each rank printed.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/error.h"

namespace pcpkv::test {

struct RankOutcome {
  int exit_code = -1;   // exit status, or -1 when killed by a signal
  int signal = 0;       // the signal that ended it (0: exited)
  bool timed_out = false;
  std::string output;   // what the rank printed (stdout + stderr)
  double seconds = 0;   // wall time until the parent saw it end
};

/// A private temporary directory (mode 0700), removed on destruction.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/pcpkv-test-XXXXXX";
    const char* p = ::mkdtemp(tmpl);
    if (!p) throw std::runtime_error("mkdtemp failed");
    path = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// Fails the child with a message (use inside rank bodies instead of EXPECT_*, which a child cannot report).
#define RANK_CHECK(cond, ...)                                                                           \
  do {                                                                                                  \
    if (!(cond)) {                                                                                      \
      std::fprintf(stderr, "RANK_CHECK failed at %s:%d: %s: %s\n", __FILE__, __LINE__, #cond,         \
                   fmt::format(__VA_ARGS__).c_str());                                                   \
      std::fflush(stderr);                                                                              \
      return 1;                                                                                         \
    }                                                                                                   \
  } while (0)

/// Runs body(config) in n forked processes. configure(rank, config) may alter a rank's config (a wrong
/// token, another world size). Waits at most wait_s seconds, then SIGKILLs the rest (timed_out = true).
inline std::vector<RankOutcome> run_ranks(int n, const std::function<int(const BootstrapConfig&)>& body,
                                          double timeout_s = 20.0, double wait_s = 60.0,
                                          const std::function<void(int, BootstrapConfig&)>& configure = {}) {
  TempDir dir;
  const std::string token = make_job_token();
  std::vector<pid_t> pids(n, -1);
  std::vector<std::string> logs(n);
  std::fflush(stdout);
  std::fflush(stderr);
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < n; ++r) {
    logs[r] = fmt::format("{}/rank{}.log", dir.path, r);
    BootstrapConfig c;
    c.rank = r;
    c.world_size = n;
    c.local_rank = r;
    c.local_world_size = n;
    c.address = dir.path + "/boot.sock";
    c.token = token;
    c.timeout_s = timeout_s;
    c.source = "test";
    if (configure) configure(r, c);
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int fd = ::open(logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
      int code = 0;
      try {
        code = body(c);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ERROR: %s\n", e.what());
        code = 3;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);
    }
    pids[r] = pid;
  }
  std::vector<RankOutcome> out(n);
  int left = n;
  const auto deadline = t0 + std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      if (pids[r] < 0) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        out[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        out[r].signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
        out[r].seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        pids[r] = -1;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < n; ++r)
        if (pids[r] > 0) {
          ::kill(pids[r], SIGKILL);
          ::waitpid(pids[r], nullptr, 0);
          out[r].timed_out = true;
          out[r].signal = SIGKILL;
          pids[r] = -1;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < n; ++r) {
    std::ifstream f(logs[r]);
    std::stringstream ss;
    ss << f.rdbuf();
    out[r].output = ss.str();
  }
  return out;
}

/// "rank 0: exit 0 ...\n" for failure messages.
inline std::string describe(const std::vector<RankOutcome>& v) {
  std::string s;
  for (size_t r = 0; r < v.size(); ++r)
    s += fmt::format("--- rank {}: exit {} signal {}{} after {:.2f} s\n{}", r, v[r].exit_code, v[r].signal,
                     v[r].timed_out ? " (timed out)" : "", v[r].seconds, v[r].output);
  return s;
}

inline bool all_ok(const std::vector<RankOutcome>& v) {
  for (const auto& o : v)
    if (o.exit_code != 0) return false;
  return true;
}

}  // namespace pcpkv::test
