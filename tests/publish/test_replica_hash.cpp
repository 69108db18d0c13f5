// pcpkv-test-labels: unit
// The run-time replica check (pcpkv/publish/replica_hash.h, docs/spec.md section 5.2) on the CPU: the hash's fixed
// values (the same in python/tests/test_replica_check.py), that any single-byte change of a hashed row changes its
// hash (and the digest), that a clean publication passes with every transport, that a corrupted byte in one replica
// fails naming the layer, the rank and the slot, that bytes outside the written rows are never read, the switch
// PCPKV_CHECK_REPLICAS, and the errors on bad input.
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "pcpkv/core/error.h"
#include "pcpkv/device/replica_hash.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/checks.h"
#include "pcpkv/publish/replica_hash.h"
#include "support/publish_case.h"

namespace pcpkv {
namespace {

// A dense fp8_ds_mla replica of 2 blocks x 4 slots with an indexer cache, every byte from a formula (the same in
// python/tests/test_replica_check.py::test_the_hash_is_the_cpp_definition).
struct PatternCache {
  CacheFormat fmt;
  std::vector<uint8_t> mla, index;
  CacheTarget target;
  PatternCache() {
    fmt.kv_format = KvFormat::kFp8DsMla;
    fmt.has_indexer = true;
    target.mla = dense_mla_geometry(fmt.kv_format, 2, 4);
    target.index = dense_indexer_geometry(2, 4);
    mla.resize(static_cast<size_t>(target.mla.bytes()));
    index.resize(static_cast<size_t>(target.index.bytes()));
    for (int64_t s = 0; s < 8; ++s) {
      for (int64_t j = 0; j < 656; ++j) mla[target.mla.row_offset(s) + j] = static_cast<uint8_t>(s * 31 + j * 7 + 3);
      for (int64_t j = 0; j < 128; ++j)
        index[target.index.data_offset(s) + j] = static_cast<uint8_t>(s * 17 + j * 11 + 5);
      for (int64_t k = 0; k < 4; ++k) index[target.index.scale_offset(s) + k] = static_cast<uint8_t>(s * 13 + k * 29 + 1);
    }
    target.mla_base = mla.data();
    target.index_base = index.data();
  }
};

TEST(ReplicaHash, FixedValuesOfTheDefinition) {
  // splitmix64's first outputs from state 0 (already odd, so | 1 keeps them).
  EXPECT_EQ(hash::replica_hash_weight(0), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(hash::replica_hash_weight(1), 0x6E789E6AA1B965F5ull);
  for (uint64_t j = 0; j < hash::kMaxHashedBytes; ++j) EXPECT_EQ(hash::replica_hash_weight(j) & 1, 1u) << j;
  PatternCache c;
  EXPECT_EQ(slot_hashes_reference(c.target, c.fmt, {5, 2, 7}),
            (std::vector<uint64_t>{0x410BA49A32B1B98Eull, 0x5BC997F4B7878A5Eull, 0x971960CA7DEF46AEull}));
  CacheFormat shared = c.fmt;  // a layer without an indexer hashes the MLA row alone
  shared.has_indexer = false;
  EXPECT_EQ(slot_hashes_reference(c.target, shared, {5, 2, 7}),
            (std::vector<uint64_t>{0xE8A5D29897B52944ull, 0xA3848E0DAF67904Eull, 0xB0752CA762797EE8ull}));
  EXPECT_EQ(replica_hash_bytes_per_slot(c.fmt), 656 + 132);
  EXPECT_EQ(replica_hash_bytes_per_slot(shared), 656);
}

// Every hashed byte of every format, changed by several deltas: that slot's hash and the digest change, no other.
TEST(ReplicaHash, AnySingleByteChangeChangesTheHashAndTheDigest) {
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16}) {
    CacheFormat fmt;
    fmt.kv_format = f;
    fmt.has_indexer = true;
    CacheTarget t;
    t.mla = dense_mla_geometry(f, 2, 4);
    t.index = dense_indexer_geometry(2, 4);
    std::vector<uint8_t> mla(static_cast<size_t>(t.mla.bytes())), index(static_cast<size_t>(t.index.bytes()));
    std::mt19937_64 gen(17 + static_cast<int>(f));
    for (uint8_t& b : mla) b = static_cast<uint8_t>(gen());
    for (uint8_t& b : index) b = static_cast<uint8_t>(gen());
    t.mla_base = mla.data();
    t.index_base = index.data();
    const std::vector<int64_t> slots = {6, 1, 3};
    const std::vector<uint64_t> base = slot_hashes_reference(t, fmt, slots);
    const uint64_t digest = replica_hashes_digest(base);
    const int64_t row = mla_row_bytes(f);
    auto expect_one_change = [&](uint8_t* byte, size_t which, const std::string& where) {
      for (int delta : {1, 2, 0x40, 0x80, 0xFF}) {
        *byte ^= static_cast<uint8_t>(delta);
        const std::vector<uint64_t> h = slot_hashes_reference(t, fmt, slots);
        *byte ^= static_cast<uint8_t>(delta);
        for (size_t i = 0; i < slots.size(); ++i)
          ASSERT_EQ(h[i] != base[i], i == which) << to_string(f) << " " << where << " ^ " << delta << ", slot " << i;
        ASSERT_NE(replica_hashes_digest(h), digest) << to_string(f) << " " << where << " ^ " << delta;
      }
    };
    for (size_t i = 0; i < slots.size(); ++i) {
      for (int64_t j = 0; j < row; ++j)
        expect_one_change(&mla[t.mla.row_offset(slots[i]) + j], i, fmt::format("MLA byte {}", j));
      for (int64_t j = 0; j < 128; ++j)
        expect_one_change(&index[t.index.data_offset(slots[i]) + j], i, fmt::format("indexer byte {}", j));
      for (int64_t k = 0; k < 4; ++k)
        expect_one_change(&index[t.index.scale_offset(slots[i]) + k], i, fmt::format("scale byte {}", k));
    }
  }
}

TEST(ReplicaHash, WrittenSlotsFollowTheGatheredMapping) {
  test::CaseSpec spec;
  spec.pcp = 3;
  spec.requests = {{RequestKind::kPrefill, 40, 0}, {RequestKind::kDecode, 1, 20}};
  auto c = test::make_case(spec);
  std::vector<int64_t> expect;
  for (int64_t s : c->plan.gathered_slot_mapping)
    if (s >= 0) expect.push_back(s);
  EXPECT_EQ(written_slots(c->plan), expect);
  EXPECT_EQ(static_cast<int64_t>(expect.size()), c->plan.num_written_slots());
  EXPECT_LT(static_cast<int64_t>(expect.size()), static_cast<int64_t>(c->plan.gathered_slot_mapping.size()))
      << "the case should have padding and decode copies (slot -1)";
}

struct Published {
  std::unique_ptr<test::PublishCase> c;
  PublishResult r;
};

Published publish(Transport t, bool has_indexer = true, AllocationOptions alloc = {}) {
  test::CaseSpec spec;
  spec.pcp = 4;
  spec.requests = {{RequestKind::kPrefill, 61, 0}, {RequestKind::kDecode, 1, 30}, {RequestKind::kDecode, 1, 7}};
  spec.fmt.has_indexer = has_indexer;
  spec.alloc = alloc;
  spec.extra_blocks = 2;
  Published run;
  run.c = test::make_case(spec);
  run.r = make_cpu_backend(2)->publish(run.c->setup, run.c->inputs, t);
  return run;
}

TEST(ReplicaHash, CleanPublicationsPassWithEveryTransport) {
  for (Transport t : {Transport::kCollect, Transport::kStaging, Transport::kDirect})
    for (bool indexer : {true, false}) {
      const Published run = publish(t, indexer);
      const Check c = check_replica_hashes(run.r, run.c->plan, run.c->setup.fmt, 3);
      EXPECT_TRUE(c.pass) << c.detail;
      EXPECT_EQ(c.name, "replica hashes agree");
      EXPECT_EQ(c.transport, to_string(t));
      const int64_t n = run.c->plan.num_written_slots();
      EXPECT_EQ(c.num_bytes, 4 * n * replica_hash_bytes_per_slot(run.c->setup.fmt));
      EXPECT_EQ(c.num_diff, 0);
      EXPECT_NE(c.detail.find(fmt::format("4 replicas x {} written slots", n)), std::string::npos) << c.detail;
      EXPECT_NE(c.detail.find(fmt::format("layer 3 ({})", to_string(t))), std::string::npos) << c.detail;
    }
}

// One flipped bit in a written row of one replica (MLA row, indexer data, indexer scale): the check fails naming
// the layer, the transport, the rank and the slot; the byte comparison of check_replicas_identical agrees.
TEST(ReplicaHash, ACorruptedByteInOneReplicaIsNamed) {
  Published run = publish(Transport::kDirect);
  const PcpPlan& plan = run.c->plan;
  const CacheFormat& fmt = run.c->setup.fmt;
  const std::vector<int64_t> slots = written_slots(plan);
  const int64_t i = static_cast<int64_t>(slots.size()) / 2;
  const int64_t slot = slots[static_cast<size_t>(i)];
  const int64_t offsets[] = {run.r.mla_cache_offset + run.r.mla_geometry.row_offset(slot) + 100,
                             run.r.index_cache_offset + run.r.index_geometry.data_offset(slot) + 127,
                             run.r.index_cache_offset + run.r.index_geometry.scale_offset(slot) + 3};
  for (int k = 0; k < 3; ++k) {
    std::vector<uint8_t>& bytes = k == 0 ? run.r.mla_alloc[2] : run.r.index_alloc[2];
    bytes[static_cast<size_t>(offsets[k])] ^= 0x10;
    const Check c = check_replica_hashes(run.r, plan, fmt, 5);
    EXPECT_FALSE(check_replicas_identical(run.r, fmt).pass);
    bytes[static_cast<size_t>(offsets[k])] ^= 0x10;
    EXPECT_FALSE(c.pass) << k;
    EXPECT_EQ(c.num_diff, 1) << k;
    EXPECT_NE(c.detail.find(fmt::format("layer 5 (direct): rank 2 differs from rank 0 at slot {} (the first differing "
                                        "slot of the {} written in this layer; differing slots per rank: 2: 1); "
                                        "replicas diverged",
                                        slot, slots.size())),
              std::string::npos)
        << k << ": " << c.detail;
  }
  EXPECT_TRUE(check_replica_hashes(run.r, plan, fmt, 5).pass) << "restored";
}

TEST(ReplicaHash, SeveralRanksAndSlotsAreListed) {
  Published run = publish(Transport::kStaging);
  const PcpPlan& plan = run.c->plan;
  const std::vector<int64_t> slots = written_slots(plan);
  auto flip = [&](int q, size_t i) {
    run.r.mla_alloc[static_cast<size_t>(q)][run.r.mla_cache_offset + run.r.mla_geometry.row_offset(slots[i])] ^= 1;
  };
  flip(1, 9);
  flip(3, 9);
  flip(3, 20);
  flip(2, 30);  // differs only later
  const Check c = check_replica_hashes(run.r, plan, run.c->setup.fmt, 0);
  EXPECT_FALSE(c.pass);
  EXPECT_EQ(c.num_diff, 4);
  EXPECT_NE(c.detail.find(fmt::format("layer 0 (staging): ranks 1, 3 differ from rank 0 at slot {} (", slots[9])),
            std::string::npos)
      << c.detail;
  EXPECT_NE(c.detail.find("differing slots per rank: 1: 1, 2: 1, 3: 2); rank 2 also differs at later slots; replicas "
                          "diverged"),
            std::string::npos)
      << c.detail;
}

// The check reads only the hashed bytes of written slots: guard bytes, the base offset, row and block padding,
// unwritten slots (the null block, the extra blocks) and the indexer cache of a shared layer may hold anything.
TEST(ReplicaHash, OnlyWrittenRowsAreRead) {
  AllocationOptions alloc;
  alloc.guard_bytes = 64;
  alloc.base_offset = 32;
  alloc.mla_row_pad = 16;
  alloc.mla_block_pad = 48;
  alloc.index_block_pad = 16;
  for (bool indexer : {true, false}) {
    Published run = publish(Transport::kDirect, indexer, alloc);
    const PcpPlan& plan = run.c->plan;
    const CacheFormat& fmt = run.c->setup.fmt;
    std::vector<bool> hashed_mla(run.r.mla_alloc[1].size()), hashed_index(run.r.index_alloc[1].size());
    for (int64_t s : written_slots(plan)) {
      for (int64_t j = 0; j < mla_row_bytes(fmt.kv_format); ++j)
        hashed_mla[static_cast<size_t>(run.r.mla_cache_offset + run.r.mla_geometry.row_offset(s) + j)] = true;
      if (!indexer) continue;
      for (int64_t j = 0; j < 128; ++j)
        hashed_index[static_cast<size_t>(run.r.index_cache_offset + run.r.index_geometry.data_offset(s) + j)] = true;
      for (int64_t j = 0; j < 4; ++j)
        hashed_index[static_cast<size_t>(run.r.index_cache_offset + run.r.index_geometry.scale_offset(s) + j)] = true;
    }
    int64_t changed = 0;
    for (size_t b = 0; b < hashed_mla.size(); ++b) {
      if (hashed_mla[b]) continue;
      run.r.mla_alloc[1][b] ^= 0xFF;
      ++changed;
    }
    for (size_t b = 0; b < hashed_index.size(); ++b) {
      if (hashed_index[b]) continue;
      run.r.index_alloc[1][b] ^= 0xFF;
      ++changed;
    }
    ASSERT_GT(changed, 0);
    const Check c = check_replica_hashes(run.r, plan, fmt, 0);
    EXPECT_TRUE(c.pass) << "indexer " << indexer << ": " << c.detail;
    EXPECT_FALSE(check_guards(run.r, plan, fmt).pass) << "the bytes outside the rows did change";
  }
}

TEST(ReplicaHash, CompareAndDigest) {
  EXPECT_EQ(replica_hashes_digest({}), 0u);
  const std::vector<std::vector<uint64_t>> h = {{1, 2, 3, 4}, {1, 2, 3, 4}, {1, 9, 3, 8}};
  const std::vector<ReplicaHashDiff> d = compare_replica_hashes_reference(h);
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0].num_diff, 0);
  EXPECT_EQ(d[0].first, -1);
  EXPECT_EQ(d[1].num_diff, 0);
  EXPECT_EQ(d[2].num_diff, 2);
  EXPECT_EQ(d[2].first, 1);
  const Check c = replica_hash_check(d, {40, 41, 42, 43}, 788, {7, "", "after 2 graph replays"}, {4, 5, 6});
  EXPECT_FALSE(c.pass);
  EXPECT_EQ(c.num_bytes, 3 * 4 * 788);
  // The reference rank is named like the others: rank 0 of the group is global rank 4 here (a TP group's leader).
  EXPECT_NE(c.detail.find("layer 7 (after 2 graph replays): rank 6 differs from rank 4 at slot 41"), std::string::npos)
      << c.detail;
  const Check ok = replica_hash_check(std::vector<ReplicaHashDiff>(2), {40, 41}, 788, {0, "direct", ""}, {2, 3});
  EXPECT_TRUE(ok.pass);
  EXPECT_NE(ok.detail.find("equal rank 2's hashes"), std::string::npos) << ok.detail;
  EXPECT_THROW(compare_replica_hashes_reference({}), Error);
  EXPECT_THROW(compare_replica_hashes_reference({{1, 2}, {1}}), Error);
}

TEST(ReplicaHash, BadInputIsRefusedNamingTheField) {
  PatternCache c;
  try {
    slot_hashes_reference(c.target, c.fmt, {3, 8});
    ADD_FAILURE() << "slot 8 of an 8-slot cache was hashed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slots[1] = 8 is outside [0, 8)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(slot_hashes_reference(c.target, c.fmt, {-1}), Error);
  CacheTarget no_index = c.target;
  no_index.index_base = nullptr;
  EXPECT_THROW(slot_hashes_reference(no_index, c.fmt, {0}), Error);
  CacheTarget other_blocks = c.target;
  other_blocks.index = dense_indexer_geometry(1, 8);
  EXPECT_THROW(slot_hashes_reference(other_blocks, c.fmt, {0}), Error);
  EXPECT_THROW(slot_hashes_reference(c.target, c.fmt, nullptr, 1, nullptr), Error);
  Published run = publish(Transport::kDirect);
  run.r.mla_alloc.pop_back();
  EXPECT_THROW(check_replica_hashes(run.r, run.c->plan, run.c->setup.fmt, 0), Error);
}

TEST(ReplicaHash, TheEnvironmentSwitch) {
  ::unsetenv("PCPKV_CHECK_REPLICAS");
  EXPECT_FALSE(replica_check_from_env());
  ::setenv("PCPKV_CHECK_REPLICAS", "1", 1);
  EXPECT_TRUE(replica_check_from_env());
  for (const char* off : {"0", ""}) {
    ::setenv("PCPKV_CHECK_REPLICAS", off, 1);
    EXPECT_FALSE(replica_check_from_env()) << "'" << off << "'";
  }
  ::setenv("PCPKV_CHECK_REPLICAS", "yes", 1);
  try {
    replica_check_from_env();
    ADD_FAILURE() << "'yes' was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("PCPKV_CHECK_REPLICAS: must be 1 (on) or 0 / empty / unset (off), got 'yes'"),
              std::string::npos)
        << e.what();
  }
  ::unsetenv("PCPKV_CHECK_REPLICAS");
}

TEST(ReplicaHash, CheckPublicationRunsItLastWhenAsked) {
  Published run = publish(Transport::kStaging);
  PcpPlan single_plan = single_rank_plan(run.c->plan);
  PublishSetup s = run.c->setup;
  s.plan = &single_plan;
  const PublishResult single = make_cpu_backend(2)->publish(s, run.c->inputs, Transport::kStaging);
  PublicationCase pc;
  pc.model = &run.c->model;
  pc.plan = &run.c->plan;
  pc.inputs = &run.c->inputs;
  pc.fmt = run.c->setup.fmt;
  EXPECT_EQ(check_publication(run.r, single, pc).size(), 4u) << "off by default";
  pc.check_replicas = true;
  pc.layer_idx = 2;
  std::vector<std::string> steps;
  const std::vector<Check> checks = check_publication(run.r, single, pc, [&](const std::string& w) { steps.push_back(w); });
  ASSERT_EQ(checks.size(), 5u);
  EXPECT_EQ(checks.back().name, "replica hashes agree");
  EXPECT_TRUE(checks.back().pass) << checks.back().detail;
  EXPECT_EQ(steps.back(), "replica hashes");
  EXPECT_TRUE(all_pass(checks));
}

}  // namespace
}  // namespace pcpkv
