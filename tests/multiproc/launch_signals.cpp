// Issue 31 item 11: what `pcpkv launch` leaves when a signal or the descriptor limit ends it. SIGHUP (a lost
// terminal) ended the launcher at once, leaving its private directory (and the ranks); EMFILE while it made the
// ranks' pipes exited 2 (bad input) instead of 3 and left the directory. Now: the ranks are stopped, the directory
// removed, then the launcher ends by the same signal; the system's refusal exits 3.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "support/cli_runner.h"

namespace pcpkv {
namespace {

namespace fs = std::filesystem;

// The launch directories under `parent` (pcpkv-launch-*).
std::vector<std::string> launch_dirs(const std::string& parent) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(parent))
    if (e.path().filename().string().rfind("pcpkv-launch-", 0) == 0) out.push_back(e.path().string());
  return out;
}

// Starts `pcpkv launch <args>` with its output to a file of `dir`; `open_files`: RLIMIT_NOFILE of the launcher (0:
// unchanged).
pid_t start_launch(const std::vector<std::string>& args, const test::TempDir& dir, rlim_t open_files = 0) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open((dir.path + "/out.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::close(fd);
    if (open_files > 0) {
      const rlimit rl{open_files, open_files};
      ::setrlimit(RLIMIT_NOFILE, &rl);
    }
    for (const auto& [k, v] : test::clean_env()) ::unsetenv(k.c_str());
    std::vector<std::string> all{PCPKV_CLI_PATH, "launch"};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : all) argv.push_back(s.data());
    argv.push_back(nullptr);
    ::execv(PCPKV_CLI_PATH, argv.data());
    ::_exit(127);
  }
  return pid;
}

int wait_status(pid_t pid, double limit_s) {
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(limit_s)) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ADD_FAILURE() << "the launcher did not end within " << limit_s << " s";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return status;
}

TEST(LaunchSignals, SighupOrSigusr1StopsTheRanksAndRemovesTheDirectory) {
  for (int sig : {SIGHUP, SIGUSR1}) {
    SCOPED_TRACE(sigabbrev_np(sig));
    test::TempDir parent, logs;
    const pid_t pid = start_launch(
        {"--nproc", "2", "--socket-dir", parent.path, "--program", "/bin/sleep", "--", "30"}, logs);
    for (int i = 0; i < 500 && launch_dirs(parent.path).empty(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(launch_dirs(parent.path).size(), 1u) << "the launcher made no directory";
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the ranks run
    ::kill(pid, sig);
    const int status = wait_status(pid, 20);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    EXPECT_TRUE(launch_dirs(parent.path).empty()) << "the launcher's directory was left";
  }
}

TEST(LaunchSignals, RunningOutOfDescriptorsExitsThreeAndRemovesTheDirectory) {
  test::TempDir parent, logs;
  const pid_t pid = start_launch({"--nproc", "16", "--socket-dir", parent.path, "--program", "/bin/sleep", "--", "30"},
                                 logs, 24);
  const int status = wait_status(pid, 30);
  std::ifstream in(logs.path + "/out.log");
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 3) << out;
  EXPECT_NE(out.find("launch: pipe failed after starting"), std::string::npos) << out;
  EXPECT_NE(out.find("Too many open files"), std::string::npos) << out;
  EXPECT_TRUE(launch_dirs(parent.path).empty()) << "the launcher's directory was left";
}

}  // namespace
}  // namespace pcpkv
