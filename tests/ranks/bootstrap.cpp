// pcpkv-test-labels: multiproc
// Rendezvous and collectives of the bootstrap with N forked CPU processes: data, descriptors, splits,
// and every way a rendezvous goes wrong (wrong token, world-size mismatch, a missing or dying rank).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <thread>

#include "support/fork_ranks.h"
#include "support/error_of.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/error.h"
#include "ranks/tombstone.h"

namespace pcpkv {
namespace {

using test::RankOutcome;
using test::run_ranks;

int collectives_body(const BootstrapConfig& c) {
  auto boot = Bootstrap::connect(c);
  const int w = boot->world_size();
  RANK_CHECK(boot->rank() == c.rank && w == c.world_size, "identity");
  RANK_CHECK(static_cast<int>(boot->pids().size()) == w, "pids");
  for (int r = 0; r < w; ++r) RANK_CHECK(boot->pids()[r] > 0, "pid of rank {} unknown", r);
  RANK_CHECK(boot->pids()[c.rank] == ::getpid(), "own pid");
  // Fixed-size all-gather, several rounds (collectives stay in step).
  for (int round = 0; round < 5; ++round) {
    const int64_t mine = int64_t{c.rank} * 1000 + round;
    std::vector<int64_t> all(w);
    boot->all_gather(&mine, sizeof(mine), all.data());
    for (int r = 0; r < w; ++r) RANK_CHECK(all[r] == int64_t{r} * 1000 + round, "round {} rank {}: {}", round, r, all[r]);
  }
  // Variable sizes, including empty and large (1 MiB) blobs.
  std::vector<uint8_t> blob(c.rank == 1 ? 0 : (c.rank == 2 ? (1 << 20) : 17 + c.rank));
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<uint8_t>(i * 31 + c.rank);
  const auto blobs = boot->all_gather_v(blob.data(), blob.size());
  for (int r = 0; r < w; ++r) {
    const size_t n = r == 1 ? 0 : (r == 2 ? (1 << 20) : 17 + r);
    RANK_CHECK(blobs[r].size() == n, "blob of rank {}: {} bytes", r, blobs[r].size());
    for (size_t i = 0; i < n; ++i) RANK_CHECK(blobs[r][i] == static_cast<uint8_t>(i * 31 + r), "blob byte");
  }
  boot->barrier();
  // Descriptors: each rank shares a memfd holding its rank; every rank reads every peer's.
  const int fd = ::memfd_create("bootstrap-test", MFD_CLOEXEC);
  RANK_CHECK(fd >= 0, "memfd");
  const int32_t val = 100 + c.rank;
  RANK_CHECK(::pwrite(fd, &val, 4, 0) == 4, "pwrite");
  auto fds = boot->all_gather_fds(fd);
  ::close(fd);
  for (int r = 0; r < w; ++r) {
    int32_t got = 0;
    RANK_CHECK(::pread(fds[r].get(), &got, 4, 0) == 4 && got == 100 + r, "fd of rank {} holds {}", r, got);
  }
  boot->agree(true, "", "test step");
  return 0;
}

class BootstrapWorld : public ::testing::TestWithParam<int> {};

TEST_P(BootstrapWorld, CollectivesDataAndDescriptors) {
  const auto out = run_ranks(GetParam(), collectives_body);
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}
INSTANTIATE_TEST_SUITE_P(Worlds, BootstrapWorld, ::testing::Values(1, 2, 4, 8), ::testing::PrintToStringParamName());

TEST(Bootstrap, WrongTokenIsRefusedAndNamed) {
  // Rank 1 belongs to another job. It is refused with a clear message; rank 0 keeps waiting for the right
  // rank 1, times out, and says it refused a connection with a wrong token.
  const auto out = run_ranks(
      2, [](const BootstrapConfig& c) { return Bootstrap::connect(c) ? 0 : 1; }, 2.0, 30.0,
      [](int r, BootstrapConfig& c) {
        c.job = r == 1 ? "job B" : "job A";
        if (r == 1) c.token = "not-the-job-token";
      });
  ASSERT_EQ(out[1].exit_code, 3) << test::describe(out);
  EXPECT_NE(out[1].output.find("job token mismatch"), std::string::npos) << out[1].output;
  // Both jobs are named.
  EXPECT_NE(out[1].output.find("belongs to job 'job B', rank 0 (pid"), std::string::npos) << out[1].output;
  EXPECT_NE(out[1].output.find("to job 'job A'"), std::string::npos) << out[1].output;
  ASSERT_EQ(out[0].exit_code, 3) << test::describe(out);
  EXPECT_NE(out[0].output.find("rank(s) 1 of world size 2 never connected"), std::string::npos) << out[0].output;
  EXPECT_NE(out[0].output.find("wrong job token"), std::string::npos) << out[0].output;
}

TEST(Bootstrap, WorldSizeMismatchFailsEveryRank) {
  const auto out = run_ranks(
      3, [](const BootstrapConfig& c) { return Bootstrap::connect(c) ? 0 : 1; }, 5.0, 30.0,
      [](int r, BootstrapConfig& c) {
        if (r == 2) c.world_size = 4;
      });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(out[r].exit_code, 3) << test::describe(out);
    EXPECT_NE(out[r].output.find("world size mismatch"), std::string::npos) << test::describe(out);
  }
  EXPECT_NE(out[0].output.find("rank 2"), std::string::npos) << out[0].output;
}

// A rank already connected when rank 0 fails the rendezvous, before rank 0 read its hello, learns the reason from
// the tombstone, also when it was written before this rank's recorded start (which is rounded up to the next 10 ms
// tick): it was taken for an earlier attempt's, and the rank said only "rank 0 closed the connection during
// rendezvous" (WorldSizeMismatchFailsEveryRank failed so in about 1 of 100 runs). Rank 0 here is a stand-in that
// accepts the connection and closes it; a real rank 0 removes older tombstones before it listens.
TEST(Bootstrap, AConnectedRankGetsTheReasonOfRankZerosTombstone) {
  test::TempDir d;
  const std::string address = d.path + "/boot.sock", token = make_job_token();
  bootstrap_tombstone::write(address, token, "world size mismatch: the stand-in rank 0 gave up");
  const auto out = run_ranks(
      2,
      [](const BootstrapConfig& c) {
        if (c.rank == 1) return Bootstrap::connect(c) ? 0 : 1;
        const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::strncpy(addr.sun_path, c.address.c_str(), sizeof(addr.sun_path) - 1);
        RANK_CHECK(::bind(s, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0 && ::listen(s, 4) == 0,
                   "stand-in rank 0 cannot listen at {}", c.address);
        ::close(::accept(s, nullptr, nullptr));  // rank 1's connection, closed before its hello is read
        ::close(s);
        return 0;
      },
      5.0, 30.0,
      [&](int, BootstrapConfig& c) {
        c.address = address;
        c.token = token;
      });
  EXPECT_EQ(out[1].exit_code, 3) << test::describe(out);
  EXPECT_NE(out[1].output.find("gave up the rendezvous: world size mismatch: the stand-in rank 0 gave up"),
            std::string::npos)
      << test::describe(out);
}

TEST(Bootstrap, DuplicateRankFails) {
  const auto out = run_ranks(
      3, [](const BootstrapConfig& c) { return Bootstrap::connect(c) ? 0 : 1; }, 5.0, 30.0,
      [](int r, BootstrapConfig& c) {
        if (r == 2) c.rank = 1;
      });
  EXPECT_EQ(out[0].exit_code, 3) << test::describe(out);
  EXPECT_NE(out[0].output.find("two processes claim rank 1"), std::string::npos) << test::describe(out);
}

TEST(Bootstrap, MissingRankTimesOutNamingIt) {
  // World size 3, but rank 2 never starts (it exits before connecting).
  const auto out = run_ranks(
      3,
      [](const BootstrapConfig& c) {
        if (c.rank == 2) return 0;
        return Bootstrap::connect(c) ? 0 : 1;
      },
      1.5, 30.0);
  EXPECT_EQ(out[0].exit_code, 3);
  EXPECT_NE(out[0].output.find("rank(s) 2 of world size 3 never connected"), std::string::npos)
      << test::describe(out);
  EXPECT_EQ(out[1].exit_code, 3);
  EXPECT_NE(out[1].output.find("rank(s) 2 of world size 3 never connected"), std::string::npos)
      << test::describe(out);
  EXPECT_LT(out[1].seconds, 10.0);
}

// A job whose rank 0 gave up leaves a tombstone; a retry with the same address and token (a torchrun-style
// job started again on the same MASTER_PORT) must not read it as its own: its rank 1 starts first and waits,
// its rank 0 starts later and both meet. Before, the retry's rank 1 failed at once with the dead job's reason.
TEST(Bootstrap, RetryIgnoresTheTombstoneOfAnEarlierAttempt) {
  test::TempDir d;
  const std::string token = make_job_token();
  auto same_job = [&](int, BootstrapConfig& c) {
    c.address = d.path + "/boot.sock";
    c.token = token;
  };
  const auto first = run_ranks(
      2, [](const BootstrapConfig& c) { return c.rank == 1 ? 0 : (Bootstrap::connect(c) ? 0 : 1); }, 0.5, 30.0,
      same_job);
  ASSERT_EQ(first[0].exit_code, 3) << test::describe(first);
  ASSERT_TRUE(std::filesystem::exists(d.path + "/boot.sock.failed")) << "rank 0 left no tombstone";
  const auto retry = run_ranks(
      2,
      [](const BootstrapConfig& c) {
        if (c.rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(700));
        auto b = Bootstrap::connect(c);
        b->barrier();
        return 0;
      },
      10.0, 30.0, same_job);
  EXPECT_TRUE(test::all_ok(retry)) << test::describe(retry);
}

// Files a hostile or broken earlier run leaves at the tombstone's names: a FIFO at "<socket>.failed" blocked the
// reading rank in open() forever; a symbolic link at "<socket>.failed.tmp" sent rank 0's text to its target.
TEST(Bootstrap, TombstoneNamesHoldingAFifoOrALinkNeitherHangNorWriteElsewhere) {
  test::TempDir d;
  const std::string sock = d.path + "/boot.sock";
  ASSERT_EQ(::mkfifo((sock + ".failed").c_str(), 0600), 0);
  const std::string victim = d.path + "/victim";
  { std::ofstream(victim) << "precious"; }
  ASSERT_EQ(::symlink(victim.c_str(), (sock + ".failed.tmp").c_str()), 0);
  auto at_sock = [&](int, BootstrapConfig& c) { c.address = sock; };
  // Rank 1 alone: it must time out after 1 s, not block on the FIFO.
  const auto follower = run_ranks(
      2, [](const BootstrapConfig& c) { return c.rank == 0 ? 0 : (Bootstrap::connect(c) ? 0 : 1); }, 1.0, 20.0,
      at_sock);
  EXPECT_EQ(follower[1].exit_code, 3) << test::describe(follower);
  EXPECT_NE(follower[1].output.find("rendezvous timed out after 1 s at rank 1"), std::string::npos)
      << test::describe(follower);
  EXPECT_LT(follower[1].seconds, 10.0);
  // Rank 0 alone gives up and writes its tombstone: into a file of its own, not through the link.
  ASSERT_EQ(::unlink((sock + ".failed").c_str()), 0);
  const auto root = run_ranks(
      2, [](const BootstrapConfig& c) { return c.rank == 1 ? 0 : (Bootstrap::connect(c) ? 0 : 1); }, 0.5, 20.0,
      at_sock);
  EXPECT_EQ(root[0].exit_code, 3) << test::describe(root);
  std::ifstream in(victim);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "precious");
  struct stat st {};
  ASSERT_EQ(::lstat((sock + ".failed").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
}

// The tombstone's purpose stays: a rank process that started with the job but reaches the rendezvous only
// after rank 0 gave up (a slow import) fails at once with rank 0's reason instead of its own timeout.
TEST(Bootstrap, LateRankOfTheSameAttemptGetsRankZerosReason) {
  const auto out = run_ranks(
      3,
      [](const BootstrapConfig& c) {
        if (c.rank == 2) return 0;  // never connects: rank 0 gives up after its timeout (1 s)
        if (c.rank == 1) {
          BootstrapConfig late = c;
          late.timeout_s = 20.0;
          std::this_thread::sleep_for(std::chrono::milliseconds(1800));
          return Bootstrap::connect(late) ? 0 : 1;
        }
        return Bootstrap::connect(c) ? 0 : 1;
      },
      1.0, 30.0);
  EXPECT_EQ(out[0].exit_code, 3) << test::describe(out);
  EXPECT_EQ(out[1].exit_code, 3) << test::describe(out);
  EXPECT_NE(out[1].output.find("rank 0 gave up the rendezvous"), std::string::npos) << test::describe(out);
  EXPECT_NE(out[1].output.find("rank(s) 1, 2 of world size 3 never connected"), std::string::npos)
      << test::describe(out);
  EXPECT_LT(out[1].seconds, 8.0) << test::describe(out);
}

// --timeout inf / PCPKV_BOOTSTRAP_TIMEOUT_S=1e300 mean no limit; the deadline's arithmetic overflowed and the
// rendezvous failed at once.
TEST(Bootstrap, UnboundedTimeoutIsNoLimit) {
  for (const double t : {std::numeric_limits<double>::infinity(), 1e300, 1e10}) {
    const auto out = run_ranks(
        2,
        [](const BootstrapConfig& c) {
          if (c.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
          auto b = Bootstrap::connect(c);
          int64_t mine = c.rank, all[2] = {-1, -1};
          b->all_gather(&mine, sizeof(mine), all);
          RANK_CHECK(all[0] == 0 && all[1] == 1, "all_gather");
          return 0;
        },
        t, 30.0);
    EXPECT_TRUE(test::all_ok(out)) << "timeout " << t << ": " << test::describe(out);
  }
}

TEST(Bootstrap, RankDyingInACollectiveIsNamedEverywhere) {
  const auto out = run_ranks(
      4,
      [](const BootstrapConfig& c) {
        auto boot = Bootstrap::connect(c);
        boot->barrier();
        if (c.rank == 2) ::_exit(9);  // gone without a word
        boot->barrier();
        return 0;
      },
      10.0, 30.0);
  EXPECT_EQ(out[2].exit_code, 9);
  const std::string pid_note = "rank 2 (pid";
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(out[r].exit_code, 3) << test::describe(out);
    EXPECT_NE(out[r].output.find(pid_note), std::string::npos) << test::describe(out);
    EXPECT_NE(out[r].output.find("closed its connection"), std::string::npos) << test::describe(out);
    EXPECT_LT(out[r].seconds, 8.0) << "a dead peer must be reported at once, not after the timeout";
  }
}

TEST(Bootstrap, AbortReachesEveryRank) {
  const auto out = run_ranks(3, [](const BootstrapConfig& c) {
    auto boot = Bootstrap::connect(c);
    if (c.rank == 1) {
      boot->abort("disk on fire");
      return 5;
    }
    boot->barrier();
    return 0;
  });
  EXPECT_EQ(out[1].exit_code, 5);
  for (int r : {0, 2}) {
    EXPECT_EQ(out[r].exit_code, 3) << test::describe(out);
    EXPECT_NE(out[r].output.find("rank 1 (pid"), std::string::npos) << test::describe(out);
    EXPECT_NE(out[r].output.find("disk on fire"), std::string::npos) << test::describe(out);
  }
}

TEST(Bootstrap, AgreeNamesEveryFailedRank) {
  const auto out = run_ranks(4, [](const BootstrapConfig& c) {
    auto boot = Bootstrap::connect(c);
    const bool ok = c.rank != 1 && c.rank != 3;
    boot->agree(ok, ok ? "" : fmt::format("no luck on {}", c.rank), "the thing");
    return 0;
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(out[r].exit_code, 3) << test::describe(out);
    EXPECT_NE(out[r].output.find("the thing failed on 2 of 4 ranks"), std::string::npos) << out[r].output;
    EXPECT_NE(out[r].output.find("rank 1: no luck on 1"), std::string::npos) << out[r].output;
    EXPECT_NE(out[r].output.find("rank 3: no luck on 3"), std::string::npos) << out[r].output;
  }
}

TEST(Bootstrap, SplitFormsIndependentGroups) {
  // TP2 x PCP2: groups {0,1} and {2,3}; a second split by parity gives {0,2} and {1,3}.
  const auto out = run_ranks(4, [](const BootstrapConfig& c) {
    auto world = Bootstrap::connect(c);
    auto pcp = world->split(c.rank / 2, c.rank);
    RANK_CHECK(pcp && pcp->world_size() == 2 && pcp->rank() == c.rank % 2, "pcp group");
    int32_t mine = c.rank, all[2] = {};
    pcp->all_gather(&mine, 4, all);
    RANK_CHECK(all[0] == c.rank / 2 * 2 && all[1] == c.rank / 2 * 2 + 1, "group {} holds {} {}", c.rank / 2, all[0],
               all[1]);
    auto tp = world->split(c.rank % 2, -c.rank);  // key reverses the order
    RANK_CHECK(tp && tp->world_size() == 2, "tp group");
    tp->all_gather(&mine, 4, all);
    RANK_CHECK(all[0] == c.rank % 2 + 2 && all[1] == c.rank % 2, "tp order {} {}", all[0], all[1]);
    auto none = world->split(c.rank == 3 ? -1 : 0, 0);
    RANK_CHECK((c.rank == 3) == (none == nullptr), "color -1");
    if (none) RANK_CHECK(none->world_size() == 3, "3 ranks");
    world->barrier();
    return 0;
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}

// ---- environment -------------------------------------------------------------------------------------

struct EnvGuard {
  std::vector<std::string> names{"PCPKV_RANK", "PCPKV_WORLD_SIZE", "PCPKV_LOCAL_RANK", "PCPKV_LOCAL_WORLD_SIZE",
                                 "PCPKV_BOOTSTRAP", "PCPKV_JOB_TOKEN", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                 "PCPKV_BOOTSTRAP_TIMEOUT_S", "PCPKV_ALLOW_NONLOCAL_MASTER", "PCPKV_BOOTSTRAP_DIR",
                                 "PCPKV_JOB_ID"};
  EnvGuard() {
    for (auto& n : names) ::unsetenv(n.c_str());
  }
  ~EnvGuard() {
    for (auto& n : names) ::unsetenv(n.c_str());
  }
};

TEST(BootstrapEnv, NothingSetMeansSingleProcess) {
  EnvGuard g;
  EXPECT_FALSE(bootstrap_config_from_env().has_value());
}

TEST(BootstrapEnv, TorchrunVariables) {
  EnvGuard g;
  ::setenv("RANK", "3", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("LOCAL_RANK", "3", 1);
  ::setenv("LOCAL_WORLD_SIZE", "4", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  ::setenv("TORCHELASTIC_RUN_ID", "abc", 1);
  ::setenv("PCPKV_BOOTSTRAP_DIR", "/tmp/x", 1);
  const auto c = bootstrap_config_from_env();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->rank, 3);
  EXPECT_EQ(c->world_size, 4);
  EXPECT_EQ(c->local_rank, 3);
  EXPECT_EQ(c->local_world_size, 4);
  // The job's identity: the run id and this command line (ranks of one job run one command).
  EXPECT_EQ(c->token.rfind("torchelastic:abc/cmd:", 0), 0u) << c->token;
  EXPECT_NE(c->job.find("MASTER_PORT 29500, TORCHELASTIC_RUN_ID=abc, command '"), std::string::npos) << c->job;
  EXPECT_EQ(c->address, fmt::format("/tmp/x/pcpkv-{}/port29500.sock", ::geteuid()));
  ::setenv("MASTER_ADDR", "localhost", 1);
  EXPECT_NO_THROW(bootstrap_config_from_env());
}

TEST(BootstrapEnv, RemoteMasterIsRefusedUnlessAllowed) {
  EnvGuard g;
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "192.0.2.77", 1);  // TEST-NET-1, never this host
  ::setenv("MASTER_PORT", "29500", 1);
  try {
    bootstrap_config_from_env();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR='192.0.2.77' is not this host"), std::string::npos) << e.what();
  }
  ::setenv("PCPKV_ALLOW_NONLOCAL_MASTER", "1", 1);
  EXPECT_NO_THROW(bootstrap_config_from_env());
}

TEST(BootstrapEnv, MalformedValuesNameTheVariable) {
  EnvGuard g;
  ::setenv("RANK", "abc", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  try {
    bootstrap_config_from_env();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='abc'"), std::string::npos) << e.what();
  }
  ::setenv("RANK", "2", 1);
  EXPECT_THROW(bootstrap_config_from_env(), Error);  // rank 2 of 2
  // An empty MASTER_PORT was called "not set".
  ::setenv("RANK", "0", 1);
  ::setenv("MASTER_PORT", "", 1);
  EXPECT_NE(test::error_of([] { bootstrap_config_from_env(); }).find("MASTER_PORT is set but empty"),
            std::string::npos);
  ::unsetenv("MASTER_PORT");
  EXPECT_NE(test::error_of([] { bootstrap_config_from_env(); }).find("MASTER_PORT is not set"), std::string::npos);
  ::setenv("MASTER_PORT", "29500", 1);
  ::unsetenv("RANK");
  ::setenv("PCPKV_RANK", "0", 1);
  ::setenv("PCPKV_WORLD_SIZE", "2", 1);
  try {
    bootstrap_config_from_env();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("PCPKV_BOOTSTRAP"), std::string::npos) << e.what();
  }
}

std::string env_error() {
  return test::error_of([] { bootstrap_config_from_env(); });
}

// PCPKV_ALLOW_NONLOCAL_MASTER=yes was read as off (only "1" counted), and the error then blamed MASTER_ADDR.
TEST(BootstrapEnv, AllowNonlocalMasterIsASwitch) {
  EnvGuard g;  // MASTER_ADDR unset: 127.0.0.1, this host, so only the switch can refuse
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  for (const char* off : {"", "0"}) {
    ::setenv("PCPKV_ALLOW_NONLOCAL_MASTER", off, 1);
    EXPECT_NO_THROW(bootstrap_config_from_env()) << "'" << off << "'";
  }
  for (const char* odd : {"yes", "true", "2", " 1"}) {
    ::setenv("PCPKV_ALLOW_NONLOCAL_MASTER", odd, 1);
    const std::string e = env_error();
    EXPECT_NE(e.find(std::string("PCPKV_ALLOW_NONLOCAL_MASTER: must be 1 (on) or 0 / empty / unset (off), got '") +
                     odd + "'"),
              std::string::npos)
        << e;
  }
  // A long value is clipped, not quoted whole.
  ::setenv("PCPKV_ALLOW_NONLOCAL_MASTER", std::string(5000, 'y').c_str(), 1);
  EXPECT_LT(env_error().size(), 1000u);
}

// WORLD_SIZE=2 without RANK (or RANK alone) ran silently as one process; MASTER_PORT=99999 was accepted.
TEST(BootstrapEnv, HalfSetAndInconsistentVariablesAreRefused) {
  struct Case {
    std::vector<std::pair<const char*, const char*>> vars;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{{"WORLD_SIZE", "2"}}, "WORLD_SIZE='2' is set but RANK is not"},
      {{{"RANK", "0"}}, "RANK='0' is set but WORLD_SIZE is not"},
      {{{"LOCAL_RANK", "1"}}, "LOCAL_RANK='1' is set but RANK is not"},
      {{{"LOCAL_WORLD_SIZE", "2"}, {"RANK", "0"}}, "is set but WORLD_SIZE is not"},
      {{{"PCPKV_WORLD_SIZE", "2"}}, "PCPKV_WORLD_SIZE='2' is set but PCPKV_RANK is not"},
      {{{"PCPKV_LOCAL_RANK", "0"}}, "PCPKV_LOCAL_RANK='0' is set but PCPKV_RANK is not"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "99999"}},
       "MASTER_PORT='99999' is not an integer in [1, 65535]"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}}, "MASTER_PORT='0' is not an integer in [1, 65535]"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29x"}}, "MASTER_PORT='29x'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}}, "MASTER_PORT is not set"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}},
       "LOCAL_WORLD_SIZE=2 differs from WORLD_SIZE=4: the job spans more than this host"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "29500"}},
       "LOCAL_RANK=0 differs from RANK=1"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"MASTER_PORT", "29500"}},
       "LOCAL_RANK=2 differs from RANK=0"},
      {{{"RANK", "9"}, {"WORLD_SIZE", "99999999"}, {"MASTER_PORT", "29500"}},
       "WORLD_SIZE='99999999' is not an integer in [1, 1048576]"},
  };
  for (const Case& c : cases) {
    EnvGuard g;
    for (const auto& [k, v] : c.vars) ::setenv(k, v, 1);
    const std::string e = env_error();
    EXPECT_NE(e.find(c.expect), std::string::npos) << "expected '" << c.expect << "', got: " << e;
  }
  EnvGuard g;
  ::setenv("MASTER_PORT", "29500", 1);  // alone it names no job: a single-process run
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  EXPECT_FALSE(bootstrap_config_from_env().has_value());
}

// torchrun's default TORCHELASTIC_RUN_ID is "none" for every job: it cannot tell two jobs apart.
TEST(BootstrapEnv, JobIdentity) {
  EnvGuard g;
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_PORT", "29501", 1);
  ::setenv("TORCHELASTIC_RUN_ID", "none", 1);
  auto c = bootstrap_config_from_env();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->token.rfind("port:29501/cmd:", 0), 0u) << c->token;
  ::setenv("PCPKV_JOB_ID", "nightly-7", 1);
  c = bootstrap_config_from_env();
  EXPECT_EQ(c->token, "job:nightly-7");
  EXPECT_EQ(c->job, "MASTER_PORT 29501, PCPKV_JOB_ID=nightly-7");
}

// Two jobs on one MASTER_PORT: the second rank 0 took over the socket and the jobs' ranks met. Now the
// second rank 0 is refused at once, naming the job that holds the address; the first job is untouched.
TEST(Bootstrap, SecondRankZeroAtTheSameAddressIsRefusedAtOnce) {
  const auto out = run_ranks(
      3,
      [](const BootstrapConfig& c) {
        if (c.job == "job B") {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));  // job A's rank 0 is up by then
          const auto t0 = std::chrono::steady_clock::now();
          try {
            Bootstrap::connect(c);
          } catch (const Error& e) {
            std::fprintf(stderr, "ERROR: %s\n", e.what());
            RANK_CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2), "not at once");
            return 3;
          }
          return 0;
        }
        if (c.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // after job B's try
        auto b = Bootstrap::connect(c);
        b->barrier();
        return 0;
      },
      10.0, 30.0,
      [](int r, BootstrapConfig& c) {
        c.job = "job A";
        if (r == 2) {
          c.rank = 0;
          c.world_size = 2;
          c.token = "another-token";
          c.job = "job B";
        } else {
          c.world_size = 2;
        }
      });
  EXPECT_EQ(out[0].exit_code, 0) << test::describe(out);
  EXPECT_EQ(out[1].exit_code, 0) << test::describe(out);
  ASSERT_EQ(out[2].exit_code, 3) << test::describe(out);
  EXPECT_NE(out[2].output.find("rank 0 of job 'job B' cannot rendezvous at"), std::string::npos) << out[2].output;
  EXPECT_NE(out[2].output.find("in use by the rank 0 of another job (pid"), std::string::npos) << out[2].output;
  EXPECT_NE(out[2].output.find("job 'job A')"), std::string::npos) << out[2].output;
}

TEST(Bootstrap, PublicDirectoryIsRefused) {
  test::TempDir d;
  ::chmod(d.path.c_str(), 0755);
  BootstrapConfig c;
  c.world_size = 2;
  c.address = d.path + "/s.sock";
  c.token = "t";
  c.timeout_s = 1;
  try {
    Bootstrap::connect(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be private"), std::string::npos) << e.what();
  }
}

TEST(Bootstrap, JobTokensDiffer) {
  EXPECT_EQ(make_job_token().size(), 32u);
  EXPECT_NE(make_job_token(), make_job_token());
}

}  // namespace
}  // namespace pcpkv

// GPU choice of rank processes: round-robin over the visible devices, PCPKV_DEVICE overrides.
#include "pcpkv/ranks/launch.h"

namespace pcpkv {
namespace {

TEST(LaunchDevices, RoundRobinAndOverride) {
  ::unsetenv("PCPKV_DEVICE");
  EXPECT_EQ(pick_device_round_robin(0, 1), 0);
  EXPECT_EQ(pick_device_round_robin(7, 1), 0);  // 8 ranks on one GPU
  EXPECT_EQ(pick_device_round_robin(5, 4), 1);
  EXPECT_THROW(pick_device_round_robin(0, 0), Error);
  ::setenv("PCPKV_DEVICE", "2", 1);
  EXPECT_EQ(pick_device_round_robin(0, 4), 2);
  ::setenv("PCPKV_DEVICE", "9", 1);
  try {
    pick_device_round_robin(0, 4);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("PCPKV_DEVICE='9' is not a device index in [0, 4)"), std::string::npos);
  }
  ::unsetenv("PCPKV_DEVICE");
  EXPECT_EQ(parse_launch_output("rank0"), LaunchOutput::kRank0);
  EXPECT_THROW(parse_launch_output("loud"), Error);
}

// A huge PCPKV_DEVICE, --output value or command path was quoted whole (100 KB in, a 100 KB message out):
// clipped (input_limits.h clip), the variable or flag still named.
TEST(LaunchDevices, HugeValuesAreQuotedClipped) {
  const std::string huge(100000, '7');
  ::setenv("PCPKV_DEVICE", huge.c_str(), 1);
  const std::string device = test::error_of([] { pick_device_round_robin(0, 4); });
  ::unsetenv("PCPKV_DEVICE");
  test::expect_clipped_error(device, "PCPKV_DEVICE='777", "is not a device index in [0, 4)");
  test::expect_clipped_error(test::error_of([&] { parse_launch_output(huge); }), "--output: unknown value '777",
                             "known: prefix, rank0, raw");
  LaunchOptions opts;
  opts.argv = {"/" + huge};
  test::expect_clipped_error(test::error_of([&] { (void)launch_ranks(opts, -1, -1); }), "launch: '/777",
                             "is not an executable file");
}

}  // namespace
}  // namespace pcpkv
