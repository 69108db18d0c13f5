// pcpkv-test-labels: multiproc
// The replica check's exchange between rank processes (check_replica_hashes_across, pcpkv/publish/replica_hash.h)
// with N forked CPU processes: equal hashes pass on every rank after one digest exchange; differing hashes give
// every rank the same failed Check naming the ranks and the first differing slot; ranks that hashed different
// slot counts are refused; CPU rank publishers whose plan gives the indexer cache its own blocks (docs/spec.md 4.2)
// agree, and a replica that differs in one indexer slot only is named with that slot. And the whole command:
// `pcpkv launch -- mp-publish --check-replicas` with CPU ranks passes, a rank that corrupts its replica
// (--corrupt-rank, a hidden testing aid) is named and every rank exits 1.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "pcpkv/core/error.h"
#include "pcpkv/publish/multiproc.h"
#include "pcpkv/publish/replica_hash.h"
#include "pcpkv/ranks/bootstrap.h"
#include "support/cli_runner.h"
#include "support/fork_ranks.h"
#include "support/publish_case.h"

namespace pcpkv {
namespace {

using test::clean_env;
using test::count_occurrences;
using test::describe;
using test::run_program;
using test::run_ranks;

std::vector<uint64_t> hashes_of(int rank, int world) {
  std::vector<uint64_t> h(1000);
  for (size_t i = 0; i < h.size(); ++i) h[i] = 0x9E3779B97F4A7C15ull * (i + 1);
  if (world >= 3 && rank == world - 1) h[700] ^= 1;  // the last rank diverges at 700 ...
  if (world >= 3 && rank == 1) {                     // ... rank 1 at 250 and 900
    h[250] += 5;
    h[900] += 5;
  }
  return h;
}

std::vector<int64_t> slots() {
  std::vector<int64_t> s(1000);
  for (size_t i = 0; i < s.size(); ++i) s[i] = 64 + 3 * static_cast<int64_t>(i);
  return s;
}

int body(const BootstrapConfig& c) {
  auto boot = Bootstrap::connect(c);
  const int w = boot->world_size();
  const Check chk = check_replica_hashes_across(*boot, hashes_of(c.rank, w), slots(), 788, {3, "direct", ""});
  // Every rank prints what it got; the parent compares.
  std::printf("CHECK %s | %s\n", chk.pass ? "PASS" : "FAIL", chk.detail.c_str());
  RANK_CHECK(chk.num_bytes == int64_t{w} * 1000 * 788, "num_bytes {}", chk.num_bytes);
  return 0;
}

class ReplicaCheckAcross : public ::testing::TestWithParam<int> {};

TEST_P(ReplicaCheckAcross, EveryRankGetsTheSameVerdict) {
  const int n = GetParam();
  const auto out = run_ranks(n, body);
  std::string first;
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(out[r].exit_code, 0) << describe(out);
    const size_t at = out[r].output.find("CHECK ");
    ASSERT_NE(at, std::string::npos) << describe(out);
    const std::string line = out[r].output.substr(at, out[r].output.find('\n', at) - at);
    if (r == 0) first = line;
    EXPECT_EQ(line, first) << "rank " << r;
  }
  if (n < 3) {
    EXPECT_NE(first.find("CHECK PASS | " + std::to_string(n) + " replicas x 1000 written slots"), std::string::npos)
        << first;
  } else {
    EXPECT_NE(first.find("CHECK FAIL | layer 3 (direct): rank 1 differs from rank 0 at slot " + std::to_string(64 + 3 * 250) +
                         " (the first differing slot of the 1000 written in this layer; differing slots per rank: 1: "
                         "2, " + std::to_string(n - 1) + ": 1); rank " + std::to_string(n - 1) +
                         " also differs at later slots; replicas diverged"),
              std::string::npos)
        << first;
  }
}
INSTANTIATE_TEST_SUITE_P(Worlds, ReplicaCheckAcross, ::testing::Values(1, 2, 4), ::testing::PrintToStringParamName());

TEST(ReplicaCheckAcrossMisc, DifferentSlotCountsAreRefused) {
  const auto out = run_ranks(2, [](const BootstrapConfig& c) {
    auto boot = Bootstrap::connect(c);
    std::vector<uint64_t> h(c.rank == 0 ? 10 : 11, 7);
    std::vector<int64_t> s(h.size(), 1);
    try {
      check_replica_hashes_across(*boot, h, s, 788, {0, "", ""});
    } catch (const Error& e) {
      std::printf("ERROR %s\n", e.what());
      return 0;
    }
    return 1;
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(out[r].exit_code, 0) << describe(out);
    EXPECT_NE(out[r].output.find("replica check: rank 1 hashed 11 slots"), std::string::npos) << describe(out);
  }
}

// 3 CPU rank processes publish (direct) with the indexer at its own slots in a padded indexer block stride; each
// hashes its own replica (replica_slot_hashes with written_index_slots) and the ranks compare: equal. Then the last
// rank hashes a host copy of its replica with one indexer byte flipped: every rank names it and both slots.
TEST(ReplicaCheckAcrossMisc, OwnIndexerSlotsAgreeAndADifferingIndexerSlotIsNamed) {
  const auto out = run_ranks(3, [](const BootstrapConfig& c) {
    auto boot = Bootstrap::connect(c);
    test::CaseSpec spec;
    spec.pcp = 3;
    spec.block_size = 8;
    spec.requests = {{RequestKind::kPrefill, 45, 0}, {RequestKind::kDecode, 1, 12}};
    spec.alloc.index_block_pad = 32;
    spec.own_index_blocks = true;
    spec.index_extra_blocks = 2;
    spec.seed = 5;
    const auto job = test::make_case(spec);
    auto pub = make_cpu_rank_publisher(*boot, job->setup);
    RankPublishResult mine = pub->publish(job->inputs, Transport::kDirect);
    boot->barrier();
    const std::vector<int64_t> slots = written_slots(job->plan), islots = written_index_slots(job->plan);
    RANK_CHECK(!islots.empty() && islots != slots, "the plan has no own indexer slots");
    const std::vector<uint64_t> h = pub->replica_slot_hashes(slots, islots);
    CacheTarget t;  // this rank's replica as a host copy
    t.mla_base = mine.mla_alloc.data() + mine.mla_cache_offset;
    t.mla = mine.mla_geometry;
    t.index_base = mine.index_alloc.data() + mine.index_cache_offset;
    t.index = mine.index_geometry;
    RANK_CHECK(h == slot_hashes_reference(t, job->setup.fmt, slots, islots), "rank {}: hashes of the copy differ",
               c.rank);
    const Check clean = check_replica_hashes_across(*boot, h, slots, 788, {1, "direct", ""}, {}, islots);
    std::printf("CLEAN %s | %s\n", clean.pass ? "PASS" : "FAIL", clean.detail.c_str());
    const size_t i = slots.size() / 3;
    const int64_t flip = mine.index_cache_offset + t.index.scale_offset(islots[i]);
    if (c.rank == 2) mine.index_alloc[static_cast<size_t>(flip)] ^= 4;
    const Check bad = check_replica_hashes_across(*boot, slot_hashes_reference(t, job->setup.fmt, slots, islots),
                                                  slots, 788, {1, "direct", ""}, {}, islots);
    std::printf("BAD %s | %s\n", bad.pass ? "PASS" : "FAIL", bad.detail.c_str());
    std::printf("WHERE slot %lld (indexer slot %lld)\n", static_cast<long long>(slots[i]),
                static_cast<long long>(islots[i]));
    return 0;
  });
  std::string where;
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(out[r].exit_code, 0) << describe(out);
    const std::string& o = out[r].output;
    EXPECT_NE(o.find("CLEAN PASS | 3 replicas x"), std::string::npos) << describe(out);
    const size_t at = o.find("WHERE ");
    ASSERT_NE(at, std::string::npos) << describe(out);
    where = o.substr(at + 6, o.find('\n', at) - at - 6);
    EXPECT_NE(o.find("BAD FAIL | layer 1 (direct): rank 2 differs from rank 0 at " + where +
                     " (the first differing slot of the"),
              std::string::npos)
        << describe(out);
  }
}

TEST(ReplicaCheckMpPublish, CpuRanksPassAndACorruptedReplicaIsNamed) {
  // TP 2 x PCP 2: each group checks its own replicas; global ranks name them.
  auto r = run_program({"launch", "--nproc", "4", "--timeout", "60", "--", "mp-publish", "--backend", "cpu", "--tp", "2",
                        "--tokens", "96", "--decodes", "1", "--block-size", "16", "--check-replicas"},
                       240, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  // 2 group leaders x 3 transports, each after its run; each group compares with its own first rank (0 or 2).
  for (const char* leader : {"0", "2"})
    EXPECT_EQ(count_occurrences(r.output, std::string("replica check: PASS (2 replicas x 97 written slots (788 B hashed "
                                                      "per slot) equal rank ") +
                                              leader + "'s hashes, layer 0 ("),
              3)
        << r.output;
  // A corrupted replica in the second group is named against that group's first rank (it said "from rank 0").
  r = run_program({"launch", "--nproc", "4", "--timeout", "60", "--", "mp-publish", "--backend", "cpu", "--tp", "2",
                   "--tokens", "96", "--block-size", "16", "--transport", "direct", "--check-replicas", "--corrupt-rank",
                   "3", "--no-check"},
                  240, clean_env());
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.output.find("replica check: FAIL (layer 0 (direct): rank 3 differs from rank 2 at slot "), std::string::npos)
      << r.output;

  // --no-check: the byte comparison with the reference is off, so only the replica check can see it.
  auto env = clean_env();
  env.emplace_back("PCPKV_CHECK_REPLICAS", "1");  // the variable turns the check on like the flag
  r = run_program({"launch", "--nproc", "4", "--timeout", "60", "--", "mp-publish", "--backend", "cpu", "--tokens", "96",
                   "--block-size", "16", "--transport", "direct", "--corrupt-rank", "2", "--no-check"},
                  240, env);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.output.find("replica check: FAIL (layer 0 (direct): rank 2 differs from rank 0 at slot "), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("differing slots per rank: 2: 1); replicas diverged"), std::string::npos) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "exited with code 1"), 4) << r.output;
}

}  // namespace
}  // namespace pcpkv
