// pcpkv-test-labels: unit
// Issue 31 item 7: Ctrl-C 1 s into a CPU fence wait or rank 0's rendezvous was handled at the timeout (20 s), where a
// signal handler only records the signal (Python). Every long wait runs the interrupt check (pcpkv/core/interrupt.h)
// at least every kInterruptPollMs; a check that throws ends the wait at once with its exception.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

#include "pcpkv/core/interrupt.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/ranks/fence.h"
#include "support/fork_ranks.h"

namespace pcpkv {
namespace {

using Clock = std::chrono::steady_clock;

struct Interrupted : std::runtime_error {
  Interrupted() : std::runtime_error("interrupted") {}
};

std::atomic<bool> g_pending{false};
void throw_when_pending() {
  if (g_pending.exchange(false)) throw Interrupted();
}

// Sets the check, and a "signal" 300 ms from now; seconds from that signal to the end of the wait.
class InterruptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_pending = false;
    set_interrupt_check(&throw_when_pending);
  }
  void TearDown() override {
    set_interrupt_check(nullptr);
    if (signaller_.joinable()) signaller_.join();
  }
  void signal_in_300ms() {
    signaller_ = std::thread([this] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      signalled_at_ = Clock::now();
      g_pending = true;
    });
  }
  double since_signal() const { return std::chrono::duration<double>(Clock::now() - signalled_at_).count(); }

  std::thread signaller_;
  Clock::time_point signalled_at_{};
};

TEST_F(InterruptTest, HostFenceWaitEndsAtTheInterrupt) {
  std::vector<uint64_t> pad0(fence_pad_elems(1, 2)), pad1(fence_pad_elems(1, 2));
  HostFence fence(0, 2, 1, {pad0.data(), pad1.data()});  // rank 1 never arrives
  signal_in_300ms();
  EXPECT_THROW(fence.arrive_and_wait(0, 20000), Interrupted);
  EXPECT_LT(since_signal(), 1.0);
}

// Rank `rank` of a job of 2 whose other rank never comes, with a 20 s timeout.
BootstrapConfig alone(int rank, const test::TempDir& d) {
  BootstrapConfig c;
  c.rank = c.local_rank = rank;
  c.world_size = c.local_world_size = 2;
  c.address = d.path + "/boot.sock";
  c.token = make_job_token();
  c.timeout_s = 20;
  return c;
}

TEST_F(InterruptTest, RendezvousEndsAtTheInterrupt) {
  for (int rank : {0, 1}) {
    SCOPED_TRACE(rank);
    test::TempDir d;
    signal_in_300ms();
    EXPECT_THROW(Bootstrap::connect(alone(rank, d)), Interrupted);
    EXPECT_LT(since_signal(), 1.0);
    signaller_.join();
  }
}

// A collective after the rendezvous: rank 0 waits in root_gather for a rank that never sends; the interrupted rank
// tells the other, which fails promptly naming it instead of at its timeout.
TEST_F(InterruptTest, ACollectiveEndsAtTheInterruptAndThePeerIsTold) {
  set_interrupt_check(nullptr);  // the forked ranks set their own
  const auto out = test::run_ranks(
      2,
      [](const BootstrapConfig& c) {
        auto b = Bootstrap::connect(c);
        if (c.rank == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(1));  // joins the barrier after rank 0 gave up
          b->barrier();
          return 0;
        }
        set_interrupt_check(&throw_when_pending);
        std::thread([] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          g_pending = true;
        }).detach();
        try {
          b->barrier();
        } catch (const Interrupted&) {
          return 7;
        }
        return 1;
      },
      20.0, 10.0);
  EXPECT_EQ(out[0].exit_code, 7) << test::describe(out);
  EXPECT_LT(out[0].seconds, 5.0) << test::describe(out);
  EXPECT_EQ(out[1].exit_code, 3) << test::describe(out);
  EXPECT_NE(out[1].output.find(") was interrupted (a signal such as Ctrl-C)"), std::string::npos)
      << test::describe(out);
  EXPECT_LT(out[1].seconds, 5.0) << test::describe(out);
}

}  // namespace
}  // namespace pcpkv
