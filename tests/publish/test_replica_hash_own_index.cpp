// pcpkv-test-labels: unit
// The run-time replica check with the indexer cache at its own slots (docs/spec.md 4.2 and 5.2) on the CPU: an
// entry hashes its MLA row at its MLA slot and its indexer row (128 e4m3 + 4 scale bytes) at its indexer slot, with
// the one-slot form's weights. The oracle against a recomputation from raw byte offsets, fixed values (the same in
// python/tests/test_replica_check.py), every byte of a written indexer slot changes the digest and no other byte
// (padding of the padded block stride, unwritten slots, the indexer row at the MLA slot's number) does; a
// publication with its own indexer blocks passes with every transport, a corrupted indexer slot in one replica is
// named with its MLA and indexer slot, and check_fp8_bound reads each token's indexer row at its own slot.
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
#include "support/error_of.h"
#include "support/publish_case.h"

namespace pcpkv {
namespace {

constexpr int32_t kBlock = 4;

// An MLA cache of 6 blocks (padded rows and blocks) and an indexer cache of its own 9 blocks with a padded block
// stride, every byte seeded-random.
struct OwnCaches {
  CacheFormat fmt;
  std::vector<uint8_t> mla, index;
  CacheTarget target;
  explicit OwnCaches(KvFormat f, uint64_t seed) {
    fmt.kv_format = f;
    fmt.has_indexer = true;
    target.mla.num_blocks = 6;
    target.mla.block_size = kBlock;
    target.mla.row_stride = mla_row_bytes(f) + 16;
    target.mla.block_stride = kBlock * target.mla.row_stride + 32;
    target.index = IndexerCacheGeometry{9, kBlock, kBlock * kIndexerSlotBytes + 48};
    mla.resize(static_cast<size_t>(target.mla.bytes()));
    index.resize(static_cast<size_t>(target.index.bytes()));
    std::mt19937_64 gen(seed);
    for (uint8_t& b : mla) b = static_cast<uint8_t>(gen());
    for (uint8_t& b : index) b = static_cast<uint8_t>(gen());
    target.mla_base = mla.data();
    target.index_base = index.data();
  }
};

// Entries: MLA slots (24 in the cache) and their own indexer slots (36), -1 in either cache once. Entry 5's indexer
// slot is its MLA slot's number; entry 0's MLA slot 5 names an indexer slot no entry writes.
const std::vector<int64_t> kSlots = {5, 17, -1, 0, 22, 9};
const std::vector<int64_t> kIndexSlots = {30, 2, 11, -1, 35, 9};

// The hash of docs/spec.md 5.2 from raw byte offsets: the MLA row at block * block_stride + offset * row_stride,
// the indexer data at block * block_stride + offset * 128, its scale after the block's block_size * 128 data bytes.
uint64_t direct_hash(const OwnCaches& c, int64_t s, int64_t is) {
  const int64_t row = mla_row_bytes(c.fmt.kv_format);
  uint64_t h = 0;
  if (s >= 0) {
    const int64_t base = (s / kBlock) * c.target.mla.block_stride + (s % kBlock) * c.target.mla.row_stride;
    for (int64_t j = 0; j < row; ++j) h += hash::replica_hash_weight(j) * c.mla[static_cast<size_t>(base + j)];
  }
  if (is >= 0) {
    const int64_t blk = (is / kBlock) * c.target.index.block_stride;
    for (int64_t j = 0; j < 128; ++j)
      h += hash::replica_hash_weight(row + j) * c.index[static_cast<size_t>(blk + (is % kBlock) * 128 + j)];
    for (int64_t k = 0; k < 4; ++k)
      h += hash::replica_hash_weight(row + 128 + k) *
           c.index[static_cast<size_t>(blk + kBlock * 128 + (is % kBlock) * 4 + k)];
  }
  return h;
}

TEST(ReplicaHashOwnIndex, OracleEqualsTheBytesRecomputedDirectly) {
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16}) {
    const OwnCaches c(f, 40 + static_cast<uint64_t>(f));
    std::vector<uint64_t> got(kSlots.size(), 0xA5A5A5A5A5A5A5A5ull);  // poisoned: every entry must be written
    slot_hashes_reference(c.target, c.fmt, kSlots.data(), kIndexSlots.data(), static_cast<int64_t>(kSlots.size()),
                          got.data());
    uint64_t digest = 0;
    for (size_t i = 0; i < kSlots.size(); ++i) {
      const uint64_t want = direct_hash(c, kSlots[i], kIndexSlots[i]);
      EXPECT_EQ(got[i], want) << to_string(f) << " entry " << i;
      digest += hash::replica_hash_weight(i) * want;
    }
    EXPECT_EQ(replica_hashes_digest(got), digest) << to_string(f);
    EXPECT_EQ(slot_hashes_reference(c.target, c.fmt, kSlots, kIndexSlots), got) << to_string(f);
    // index_slots == slots: the one-slot form bit for bit (the digest of plans without own indexer blocks).
    const std::vector<int64_t> same = {5, 17, 1, 0, 22, 9};
    EXPECT_EQ(slot_hashes_reference(c.target, c.fmt, same, same), slot_hashes_reference(c.target, c.fmt, same));
    // A layer without an indexer ignores index_slots: its MLA rows alone.
    CacheFormat shared = c.fmt;
    shared.has_indexer = false;
    const std::vector<uint64_t> mla_only = slot_hashes_reference(c.target, shared, kSlots, kIndexSlots);
    for (size_t i = 0; i < kSlots.size(); ++i) EXPECT_EQ(mla_only[i], direct_hash(c, kSlots[i], -1)) << i;
  }
}

// The pattern of tests/publish/test_replica_hash.cpp (2 blocks x 4 slots, dense): its fixed values with
// index_slots == slots, and these with other indexer slots (the same in python/tests/test_replica_check.py).
TEST(ReplicaHashOwnIndex, FixedValues) {
  CacheFormat fmt;
  fmt.kv_format = KvFormat::kFp8DsMla;
  fmt.has_indexer = true;
  CacheTarget t;
  t.mla = dense_mla_geometry(fmt.kv_format, 2, 4);
  t.index = dense_indexer_geometry(2, 4);
  std::vector<uint8_t> mla(static_cast<size_t>(t.mla.bytes())), index(static_cast<size_t>(t.index.bytes()));
  for (int64_t s = 0; s < 8; ++s) {
    for (int64_t j = 0; j < 656; ++j) mla[t.mla.row_offset(s) + j] = static_cast<uint8_t>(s * 31 + j * 7 + 3);
    for (int64_t j = 0; j < 128; ++j) index[t.index.data_offset(s) + j] = static_cast<uint8_t>(s * 17 + j * 11 + 5);
    for (int64_t k = 0; k < 4; ++k) index[t.index.scale_offset(s) + k] = static_cast<uint8_t>(s * 13 + k * 29 + 1);
  }
  t.mla_base = mla.data();
  t.index_base = index.data();
  EXPECT_EQ(slot_hashes_reference(t, fmt, {5, 2, 7}, {5, 2, 7}),
            (std::vector<uint64_t>{0x410BA49A32B1B98Eull, 0x5BC997F4B7878A5Eull, 0x971960CA7DEF46AEull}));
  const std::vector<uint64_t> h = slot_hashes_reference(t, fmt, {5, -1, 7}, {1, 6, -1});
  EXPECT_EQ(h, (std::vector<uint64_t>{0x79A4A14DD736F196ull, 0x8AB02EB017E51108ull, 0xB0752CA762797EE8ull}));
  EXPECT_EQ(replica_hashes_digest(h), 0xF0505D6EBB9669CAull);
}

// Every byte of every written indexer slot, changed by several deltas: that entry's hash and the digest change, no
// other; every byte the entries do not hash (padding of the padded block stride, unwritten indexer slots among
// them slot 5, entry 0's MLA slot number; MLA row and block padding) changes nothing.
TEST(ReplicaHashOwnIndex, ExactlyTheWrittenIndexerSlotsBytesAreHashed) {
  OwnCaches c(KvFormat::kFp8DsMla, 7);
  const std::vector<uint64_t> base = slot_hashes_reference(c.target, c.fmt, kSlots, kIndexSlots);
  const uint64_t digest = replica_hashes_digest(base);
  std::vector<int> entry_of(c.index.size(), -1);
  for (size_t i = 0; i < kSlots.size(); ++i) {
    const int64_t is = kIndexSlots[i];
    if (is < 0) continue;
    for (int64_t j = 0; j < 128; ++j) entry_of[static_cast<size_t>(c.target.index.data_offset(is) + j)] = int(i);
    for (int64_t k = 0; k < 4; ++k) entry_of[static_cast<size_t>(c.target.index.scale_offset(is) + k)] = int(i);
  }
  int64_t hashed = 0, padding = 0;
  for (size_t b = 0; b < c.index.size(); ++b) {
    const int64_t in_block = static_cast<int64_t>(b) % c.target.index.block_stride;
    if (entry_of[b] >= 0) ++hashed;
    if (in_block >= kBlock * kIndexerSlotBytes) ++padding;
    for (int delta : {1, 0x40, 0xFF}) {
      c.index[b] ^= static_cast<uint8_t>(delta);
      const std::vector<uint64_t> h = slot_hashes_reference(c.target, c.fmt, kSlots, kIndexSlots);
      c.index[b] ^= static_cast<uint8_t>(delta);
      for (size_t i = 0; i < kSlots.size(); ++i)
        ASSERT_EQ(h[i] != base[i], entry_of[b] == static_cast<int>(i))
            << "indexer byte " << b << " (block byte " << in_block << ") ^ " << delta << ", entry " << i;
      ASSERT_EQ(replica_hashes_digest(h) != digest, entry_of[b] >= 0) << "indexer byte " << b << " ^ " << delta;
    }
  }
  EXPECT_EQ(hashed, 5 * 132);
  EXPECT_EQ(padding, 9 * 48) << "every padding byte of the padded block stride was flipped";
  // The MLA cache: bytes outside the written rows change nothing either.
  const int64_t row = mla_row_bytes(c.fmt.kv_format);
  std::vector<bool> in_row(c.mla.size());
  for (int64_t s : kSlots)
    if (s >= 0)
      for (int64_t j = 0; j < row; ++j) in_row[static_cast<size_t>(c.target.mla.row_offset(s) + j)] = true;
  for (size_t b = 0; b < c.mla.size(); ++b) {
    if (in_row[b]) continue;
    c.mla[b] ^= 0xFF;
  }
  EXPECT_EQ(slot_hashes_reference(c.target, c.fmt, kSlots, kIndexSlots), base);
}

TEST(ReplicaHashOwnIndex, BadSlotsAreRefusedNamingTheField) {
  const OwnCaches c(KvFormat::kFp8DsMla, 3);
  EXPECT_NE(test::error_of([&] { slot_hashes_reference(c.target, c.fmt, {1, 2}, {4, 36}); })
                .find("slot hashes: index_slots[1] = 36 is outside [0, 36) (the cache's slots; -1: none)"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { slot_hashes_reference(c.target, c.fmt, {-2}, {4}); })
                .find("slot hashes: slots[0] = -2 is outside [0, 24)"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { slot_hashes_reference(c.target, c.fmt, {1, 2}, {4}); })
                .find("slot hashes: index_slots has 1 entries, slots 2"),
            std::string::npos);
  // The one-slot form still needs the indexer cache to cover the MLA cache; the own-slot form does not.
  OwnCaches small(KvFormat::kFp8DsMla, 3);
  small.target.index.num_blocks = 2;
  EXPECT_THROW(slot_hashes_reference(small.target, small.fmt, {1}), Error);
  EXPECT_EQ(slot_hashes_reference(small.target, small.fmt, {20}, {7}).size(), 1u);
  EXPECT_THROW(replica_hash_check(std::vector<ReplicaHashDiff>(2), {1, 2}, 788, {0, "", ""}, {}, {3}), Error);
}

// The mismatch names the entry by both slots, or says which cache it has no row in.
TEST(ReplicaHashOwnIndex, AMismatchNamesTheIndexerSlot) {
  const std::vector<int64_t> slots = {40, -1, 42}, islots = {7, 8, -1};
  for (int64_t first = 0; first < 3; ++first) {
    std::vector<ReplicaHashDiff> d(2);
    d[1] = {1, first};
    const Check c = replica_hash_check(d, slots, 788, {4, "direct", ""}, {}, islots);
    const char* at[] = {"at slot 40 (indexer slot 7)", "at indexer slot 8 (no MLA row)", "at slot 42 (no indexer row)"};
    EXPECT_NE(c.detail.find(fmt::format("layer 4 (direct): rank 1 differs from rank 0 {} (the first differing slot "
                                        "of the 3 written",
                                        at[first])),
              std::string::npos)
        << c.detail;
  }
}

struct Published {
  std::unique_ptr<test::PublishCase> c;
  PublishResult r;
};

// A publication whose plan gives the indexer cache its own blocks (another permutation, 3 spare blocks) with a
// padded indexer block stride, over 4 ranks.
Published publish_own(Transport t) {
  test::CaseSpec spec;
  spec.pcp = 4;
  spec.block_size = 8;
  spec.requests = {{RequestKind::kPrefill, 61, 0}, {RequestKind::kDecode, 1, 30}, {RequestKind::kDecode, 1, 7}};
  spec.extra_blocks = 2;
  spec.alloc.index_block_pad = 48;
  spec.own_index_blocks = true;
  spec.index_extra_blocks = 3;
  spec.seed = 11;
  Published run;
  run.c = test::make_case(spec);
  run.r = make_cpu_backend(2)->publish(run.c->setup, run.c->inputs, t);
  return run;
}

TEST(ReplicaHashOwnIndex, APublicationPassesAndACorruptIndexerSlotIsNamed) {
  for (Transport t : {Transport::kCollect, Transport::kStaging, Transport::kDirect}) {
    Published run = publish_own(t);
    const PcpPlan& plan = run.c->plan;
    const CacheFormat& fmt = run.c->setup.fmt;
    ASSERT_TRUE(plan.has_index_slots());
    const std::vector<int64_t> slots = written_slots(plan), islots = written_index_slots(plan);
    ASSERT_EQ(slots.size(), islots.size());
    const Check clean = check_replica_hashes(run.r, plan, fmt, 3);
    EXPECT_TRUE(clean.pass) << to_string(t) << ": " << clean.detail;
    EXPECT_EQ(clean.num_bytes, 4 * static_cast<int64_t>(slots.size()) * (656 + 132));
    // An entry whose indexer slot differs from its MLA slot: one bit of its indexer data, then of its scale.
    size_t i = slots.size() / 2;
    while (islots[i] == slots[i]) ++i;
    const IndexerCacheGeometry& ig = run.r.index_geometry;
    for (int64_t off : {ig.data_offset(islots[i]) + 5, ig.scale_offset(islots[i]) + 2}) {
      uint8_t& byte = run.r.index_alloc[2][static_cast<size_t>(run.r.index_cache_offset + off)];
      byte ^= 0x20;
      const Check bad = check_replica_hashes(run.r, plan, fmt, 3);
      byte ^= 0x20;
      EXPECT_FALSE(bad.pass) << to_string(t);
      EXPECT_EQ(bad.num_diff, 1);
      EXPECT_NE(bad.detail.find(fmt::format("layer 3 ({}): rank 2 differs from rank 0 at slot {} (indexer slot {}) "
                                            "(the first differing slot of the {} written in this layer",
                                            to_string(t), slots[i], islots[i], slots.size())),
                std::string::npos)
          << bad.detail;
    }
    // The padding of every indexer block of rank 1 (never written, not hashed): still passes; the guard check sees it.
    for (int64_t b = 0; b < ig.num_blocks; ++b)
      run.r.index_alloc[1][static_cast<size_t>(run.r.index_cache_offset + b * ig.block_stride +
                                               ig.block_size * kIndexerSlotBytes + 47)] ^= 0xFF;
    EXPECT_TRUE(check_replica_hashes(run.r, plan, fmt, 3).pass) << to_string(t);
    EXPECT_FALSE(check_guards(run.r, plan, fmt).pass) << "the padding did change";
  }
}

// check_fp8_bound reads each token's indexer row at its own slot: a clean publication is within the bound (it was
// refused before), one flipped exponent bit of a token's indexer e4m3 byte at its own slot is over it.
TEST(ReplicaHashOwnIndex, TheFp8BoundReadsTheIndexerRowAtItsOwnSlot) {
  for (Transport t : {Transport::kDirect, Transport::kCollect}) {
    Published run = publish_own(t);
    const PcpPlan& plan = run.c->plan;
    const bool bf16_first = t == Transport::kCollect;
    const Fp8Report ok = check_fp8_bound(run.r, 1, run.c->inputs, plan, run.c->model, run.c->setup.fmt, bf16_first);
    EXPECT_EQ(ok.num_over_bound, 0) << to_string(t) << ": " << ok.worst;
    EXPECT_LE(ok.max_err_over_bound, 1.0) << ok.worst;
    EXPECT_EQ(ok.num_values, plan.num_written_slots() * (512 + 64 + 128));
    const int64_t g = 17;  // a token whose indexer slot is not its MLA slot
    ASSERT_NE(plan.global_index_slots[g], plan.global_slots[g]);
    const int64_t off = run.r.index_cache_offset + run.r.index_geometry.data_offset(plan.global_index_slots[g]) + 9;
    run.r.index_alloc[1][static_cast<size_t>(off)] ^= 0x40;
    const Fp8Report bad = check_fp8_bound(run.r, 1, run.c->inputs, plan, run.c->model, run.c->setup.fmt, bf16_first);
    EXPECT_GE(bad.num_over_bound, 1) << to_string(t);
    EXPECT_NE(bad.worst.find(fmt::format("rank 1 slot {} (indexer slot {}; token {},", plan.global_slots[g],
                                         plan.global_index_slots[g], g)),
              std::string::npos)
        << bad.worst;
  }
}

}  // namespace
}  // namespace pcpkv
