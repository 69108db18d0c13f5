// pcpkv-test-labels: unit
// The indexer cache at its own slots (docs/spec.md section 4.2, issue 35 item 3): with an indexer_slot_mapping the
// dispatch (direct), the staging combine and the collect insert put a token's indexer row at its own slot of an
// indexer cache of its own geometry (block count, padded block stride), each mapping's -1 skipping its own cache.
// Expected caches are built here from the token's transport row (the dispatch's row_dests output), byte for byte,
// guard bytes, padding and unwritten slots included (all 0xA5).
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include <gtest/gtest.h>

#include "pcpkv/core/rope.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/publish/replica_hash.h"
#include "support/bytes.h"
#include "support/publish_case.h"
#include "support/error_of.h"
#include "support/guard.h"
#include "support/random_bf16.h"

namespace pcpkv {
namespace {

using test::GuardedBuffer;

constexpr int64_t kT = 12;
constexpr int32_t kBlock = 4;
constexpr int64_t kGuard = 256;

// One batch of kT tokens, an MLA cache of 8 blocks and an indexer cache of 5 blocks with a padded block stride.
struct Step {
  CacheFormat fmt;
  std::vector<uint16_t> kv, k_pe, index_k;
  std::vector<int64_t> positions;
  std::vector<float> kv_w, ln_w, ln_b;
  RopeTable rope;
  MlaCacheGeometry mg;
  IndexerCacheGeometry ig;
  GuardedBuffer mla, idx;
  // MLA slots: tokens 0..11 over the 32 MLA slots; token 4's MLA slot -1 (its indexer row still lands).
  std::vector<int64_t> slots = {3, 17, 30, 8, -1, 22, 11, 0, 27, 5, 14, 19};
  // Indexer slots in [0, 20): other slots than the MLA ones, token 9's -1 (its MLA row still lands); 25 of
  // token 2's MLA slot would be out of this cache.
  std::vector<int64_t> index_slots = {12, 1, 19, 6, 10, 0, 15, 7, 2, -1, 18, 4};

  explicit Step(KvFormat kvf, uint64_t seed)
      : fmt{kvf, DsMlaScale::kPow2, 0.05f, true},
        rope(make_rope_table(RopeConfig{}, 64)),
        mg(dense_mla_geometry(kvf, 8, kBlock)),
        ig{5, kBlock, kBlock * kIndexerSlotBytes + 48},
        mla(mg.bytes(), kGuard),
        idx(ig.bytes(), kGuard) {
    kv = test::random_bf16(kT, 512, seed + 1);
    k_pe = test::random_bf16(kT, 64, seed + 2, 2, 2.0);
    index_k = test::random_bf16(kT, 128, seed + 3);
    kv_w = test::random_weights(512, seed + 4, 1.0, 0.3);
    ln_w = test::random_weights(128, seed + 5, 1.0, 0.2);
    ln_b = test::random_weights(128, seed + 6, 0.0, 0.05);
    for (int64_t t = 0; t < kT; ++t) positions.push_back((t * 7 + 3) % 64);
  }

  CacheTarget target() { return CacheTarget{mla.data(), mg, idx.data(), ig}; }

  DispatchParams params() {
    DispatchParams p;
    p.num_tokens = kT;
    p.kv = kv.data();
    p.k_pe = k_pe.data();
    p.index_k = index_k.data();
    p.positions = positions.data();
    p.kv_norm_w = kv_w.data();
    p.index_ln_w = ln_w.data();
    p.index_ln_b = ln_b.data();
    p.rope_cos_sin = rope.cos_sin.data();
    p.rope_num_positions = rope.num_positions;
    p.fmt = fmt;
    p.slot_mapping = slots.data();
    p.indexer_slot_mapping = index_slots.data();
    return p;
  }

  // Every token's transport row (the bytes the caches must receive).
  std::vector<uint8_t> transport_rows() {
    const int64_t rb = transport_row_layout(fmt).row_bytes;
    std::vector<uint8_t> rows(static_cast<size_t>(kT * rb), 0);
    uint8_t* dest = rows.data();
    DispatchParams p = params();
    p.num_row_dests = 1;
    p.row_dests = &dest;
    p.row_bytes = rb;
    dispatch_reference(p);
    return rows;
  }

  // The whole allocations (guards included) the caches must hold after writing `rows` (one per token).
  void expected(const std::vector<uint8_t>& rows, std::vector<uint8_t>& mla_img, std::vector<uint8_t>& idx_img) const {
    const TransportRowLayout l = transport_row_layout(fmt);
    mla_img.assign(static_cast<size_t>(mg.bytes() + 2 * kGuard), 0xA5);
    idx_img.assign(static_cast<size_t>(ig.bytes() + 2 * kGuard), 0xA5);
    for (int64_t t = 0; t < kT; ++t) {
      const uint8_t* row = rows.data() + t * l.row_bytes;
      const int64_t s = slots[static_cast<size_t>(t)], is = index_slots[static_cast<size_t>(t)];
      if (s >= 0) std::memcpy(mla_img.data() + kGuard + mg.row_offset(s), row, static_cast<size_t>(l.mla_bytes));
      if (is >= 0) {
        std::memcpy(idx_img.data() + kGuard + ig.data_offset(is), row + l.index_data_offset, 128);
        std::memcpy(idx_img.data() + kGuard + ig.scale_offset(is), row + l.index_scale_offset, 4);
      }
    }
  }

  ::testing::AssertionResult caches_equal(const std::vector<uint8_t>& rows, const std::string& what) const {
    std::vector<uint8_t> mla_img, idx_img;
    expected(rows, mla_img, idx_img);
    auto r = test::bytes_equal(mla_img.data(), mla.data() - kGuard, mg.bytes() + 2 * kGuard, what + ": MLA cache");
    if (!r) return r;
    return test::bytes_equal(idx_img.data(), idx.data() - kGuard, ig.bytes() + 2 * kGuard, what + ": indexer cache");
  }
};

const KvFormat kFormats[] = {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16};

TEST(IndexSlots, DispatchWritesTheIndexerRowAtItsOwnSlotOfAPaddedSmallerCache) {
  for (KvFormat kvf : kFormats) {
    Step s(kvf, 11);
    const std::vector<uint8_t> rows = s.transport_rows();
    CacheTarget t = s.target();
    DispatchParams p = s.params();
    p.targets = &t;
    p.num_targets = 1;
    dispatch_reference(p, 3);
    EXPECT_TRUE(s.caches_equal(rows, fmt::format("{} direct", to_string(kvf))));
  }
}

TEST(IndexSlots, TwoReplicasOfDifferentPaddingGetTheSameRows) {
  Step s(KvFormat::kFp8DsMla, 21), s2(KvFormat::kFp8DsMla, 21);
  s2.ig.block_stride = kBlock * kIndexerSlotBytes + 208;  // another padding: the offsets differ, the rows do not
  GuardedBuffer idx2(s2.ig.bytes(), kGuard);
  CacheTarget t[2] = {s.target(), CacheTarget{s2.mla.data(), s2.mg, idx2.data(), s2.ig}};
  DispatchParams p = s.params();
  p.targets = t;
  p.num_targets = 2;
  dispatch_reference(p);
  const std::vector<uint8_t> rows = s.transport_rows();
  EXPECT_TRUE(s.caches_equal(rows, "replica 0"));
  std::vector<uint8_t> mla_img, idx_img;
  s2.expected(rows, mla_img, idx_img);
  EXPECT_TRUE(test::bytes_equal(idx_img.data(), idx2.data() - kGuard, s2.ig.bytes() + 2 * kGuard, "replica 1 indexer"));
  EXPECT_TRUE(test::bytes_equal(mla_img.data(), s2.mla.data() - kGuard, s2.mg.bytes() + 2 * kGuard, "replica 1 MLA"));
}

TEST(IndexSlots, CombineCarriesBothSlotsAndEqualsDirect) {
  for (KvFormat kvf : kFormats) {
    Step s(kvf, 31);
    const std::vector<uint8_t> rows = s.transport_rows();
    CombineParams c;
    c.rows = rows.data();
    c.num_src_ranks = 2;  // rank-major: 2 ranks of 6 rows
    c.max_local_tokens = kT / 2;
    c.row_bytes = transport_row_layout(s.fmt).row_bytes;
    c.slot_mapping = s.slots.data();
    c.indexer_slot_mapping = s.index_slots.data();
    c.fmt = s.fmt;
    c.target = s.target();
    combine_reference(c, 2);
    EXPECT_TRUE(s.caches_equal(rows, fmt::format("{} staging combine", to_string(kvf))));
  }
}

TEST(IndexSlots, InsertPutsTheIndexerRowAtItsOwnSlot) {
  for (KvFormat kvf : kFormats) {
    Step s(kvf, 41), plain(kvf, 41);
    // The collect path's bf16 rows, inserted once with the indexer mapping and once into a plain cache by slot.
    std::vector<uint16_t> kv_c(kT * 512), k_pe(kT * 64), index_k(kT * 128);
    DispatchParams m = s.params();
    m.kv_c_out = kv_c.data();
    m.k_pe_out = k_pe.data();
    m.index_k_out = index_k.data();
    dispatch_reference(m);
    InsertParams ip;
    ip.num_tokens = kT;
    ip.kv_c = kv_c.data();
    ip.k_pe = k_pe.data();
    ip.index_k = index_k.data();
    ip.slot_mapping = s.slots.data();
    ip.indexer_slot_mapping = s.index_slots.data();
    ip.fmt = s.fmt;
    ip.target = s.target();
    insert_reference(ip, 2);
    // The same rows encoded by the single-slot insert into a cache of 8 plain blocks at slots 0..11: its
    // bytes per token are the collect rows, relocated here to both mappings.
    const TransportRowLayout l = transport_row_layout(s.fmt);
    MlaCacheGeometry pm = dense_mla_geometry(kvf, 3, kBlock);
    IndexerCacheGeometry pi = dense_indexer_geometry(3, kBlock);
    std::vector<uint8_t> pmla(static_cast<size_t>(pm.bytes())), pidx(static_cast<size_t>(pi.bytes()));
    std::vector<int64_t> seq(kT);
    for (int64_t t = 0; t < kT; ++t) seq[static_cast<size_t>(t)] = t;
    InsertParams pp = ip;
    pp.slot_mapping = seq.data();
    pp.indexer_slot_mapping = nullptr;
    pp.target = CacheTarget{pmla.data(), pm, pidx.data(), pi};
    insert_reference(pp);
    std::vector<uint8_t> rows(static_cast<size_t>(kT * l.row_bytes), 0);
    for (int64_t t = 0; t < kT; ++t) {
      std::memcpy(rows.data() + t * l.row_bytes, pmla.data() + pm.row_offset(t), static_cast<size_t>(l.mla_bytes));
      std::memcpy(rows.data() + t * l.row_bytes + l.index_data_offset, pidx.data() + pi.data_offset(t), 128);
      std::memcpy(rows.data() + t * l.row_bytes + l.index_scale_offset, pidx.data() + pi.scale_offset(t), 4);
    }
    EXPECT_TRUE(s.caches_equal(rows, fmt::format("{} collect insert", to_string(kvf))));
  }
}

TEST(IndexSlots, TheSameMappingTwiceGivesTheSingleSlotBytes) {
  // indexer_slot_mapping = slot_mapping's values (the single-slot form made explicit) writes what null writes.
  Step a(KvFormat::kFp8DsMla, 51), b(KvFormat::kFp8DsMla, 51);
  a.ig = b.ig = dense_indexer_geometry(8, kBlock);
  GuardedBuffer ia(a.ig.bytes(), kGuard), ib(b.ig.bytes(), kGuard);
  CacheTarget ta{a.mla.data(), a.mg, ia.data(), a.ig}, tb{b.mla.data(), b.mg, ib.data(), b.ig};
  DispatchParams pa = a.params(), pb = b.params();
  pa.indexer_slot_mapping = nullptr;
  std::vector<int64_t> copy = b.slots;
  pb.indexer_slot_mapping = copy.data();
  pa.targets = &ta;
  pb.targets = &tb;
  pa.num_targets = pb.num_targets = 1;
  dispatch_reference(pa);
  dispatch_reference(pb);
  EXPECT_TRUE(test::bytes_equal(a.mla.data() - kGuard, b.mla.data() - kGuard, a.mg.bytes() + 2 * kGuard, "MLA"));
  EXPECT_TRUE(test::bytes_equal(ia.data() - kGuard, ib.data() - kGuard, a.ig.bytes() + 2 * kGuard, "indexer"));
}

TEST(IndexSlots, BadIndexerSlotsAreNamedBeforeAnyWrite) {
  Step s(KvFormat::kFp8DsMla, 61);
  CacheTarget t = s.target();
  const std::vector<uint8_t> rows = s.transport_rows();
  const auto dispatch_error = [&](auto&& change) {
    Step fresh(KvFormat::kFp8DsMla, 61);
    CacheTarget ft = fresh.target();
    DispatchParams p = fresh.params();
    p.targets = &ft;
    p.num_targets = 1;
    change(fresh, p);
    const std::string e = test::error_of([&] { dispatch_reference(p); });
    EXPECT_TRUE(fresh.mla.untouched("MLA cache after: " + e));
    EXPECT_TRUE(fresh.idx.untouched("indexer cache after: " + e));
    return e;
  };
  // In range of the MLA cache (32 slots) but not of the indexer cache's 5 blocks x 4.
  EXPECT_NE(dispatch_error([](Step& f, DispatchParams&) { f.index_slots[2] = 20; })
                .find("dispatch: indexer_slot_mapping[2] = 20 is out of range [0, 20)"),
            std::string::npos);
  EXPECT_NE(
      dispatch_error([](Step& f, DispatchParams&) { f.index_slots[5] = -2; }).find("indexer_slot_mapping[5] = -2"),
      std::string::npos);
  EXPECT_NE(dispatch_error([](Step& f, DispatchParams&) { f.index_slots[7] = 12; })
                .find("indexer_slot_mapping[7] = 12 duplicates indexer_slot_mapping[0]"),
            std::string::npos);
  // The MLA mapping is checked against the MLA cache alone: slot 30 lies past the indexer cache, and is accepted
  // (Step's token 2); a slot past the MLA cache is named as slot_mapping.
  EXPECT_NE(dispatch_error([](Step& f, DispatchParams&) { f.slots[1] = 32; })
                .find("dispatch: slot_mapping[1] = 32 is out of range [0, 32)"),
            std::string::npos);
  EXPECT_NE(dispatch_error([](Step&, DispatchParams& p) {
              p.fmt.has_indexer = false;
              p.index_k = nullptr;
            }).find("dispatch: indexer_slot_mapping is set but fmt.has_indexer = false"),
            std::string::npos);
  // An indexer geometry that cannot hold its rows is named as the indexer cache's.
  EXPECT_NE(dispatch_error([](Step&, DispatchParams& p) {
              const_cast<CacheTarget*>(p.targets)->index.block_stride = kBlock * kIndexerSlotBytes - 16;
            }).find("dispatch: targets[0]"),
            std::string::npos);

  // Combine and insert: the same check, named by their op.
  Step c(KvFormat::kFp8DsMla, 61);
  c.index_slots[3] = 99;
  CombineParams cp;
  cp.rows = rows.data();
  cp.num_src_ranks = 1;
  cp.max_local_tokens = kT;
  cp.row_bytes = transport_row_layout(c.fmt).row_bytes;
  cp.slot_mapping = c.slots.data();
  cp.indexer_slot_mapping = c.index_slots.data();
  cp.fmt = c.fmt;
  cp.target = c.target();
  EXPECT_NE(
      test::error_of([&] { combine_reference(cp); }).find("combine: indexer_slot_mapping[3] = 99 is out of range"),
      std::string::npos);
  std::vector<uint16_t> bf16(kT * 512, 0x3f80);
  InsertParams ip;
  ip.num_tokens = kT;
  ip.kv_c = ip.k_pe = ip.index_k = bf16.data();
  ip.slot_mapping = c.slots.data();
  ip.indexer_slot_mapping = c.index_slots.data();
  ip.fmt = c.fmt;
  ip.target = c.target();
  EXPECT_NE(test::error_of([&] { insert_reference(ip); }).find("insert: indexer_slot_mapping[3] = 99 is out of range"),
            std::string::npos);
  EXPECT_TRUE(c.mla.untouched("combine / insert MLA cache"));
  EXPECT_TRUE(c.idx.untouched("combine / insert indexer cache"));
  (void)t;
}


// The CPU backend's three transports with a plan whose indexer cache has its own block table (another
// permutation, 3 spare blocks, a padded block stride): every replica byte-identical, staging == direct, no
// byte outside the written rows touched, and each token's indexer row equal to the one-slot plan's (same seed,
// same MLA block tables) moved to its indexer slot.
TEST(IndexSlots, EveryTransportPublishesTheIndexerRowsAtTheirOwnSlots) {
  for (int32_t pcp : {2, 3}) {
    test::CaseSpec spec;
    spec.pcp = pcp;
    spec.block_size = 8;
    spec.requests = {{RequestKind::kPrefill, 37, 0}, {RequestKind::kDecode, 1, 20}, {RequestKind::kPrefill, 13, 9}};
    spec.alloc.index_block_pad = 64;
    spec.seed = 7;
    auto plain = test::make_case(spec);
    spec.own_index_blocks = true;
    spec.index_extra_blocks = 3;
    auto own = test::make_case(spec);
    ASSERT_TRUE(own->plan.has_index_slots());
    ASSERT_EQ(own->plan.gathered_slot_mapping, plain->plan.gathered_slot_mapping);
    ASSERT_NE(own->plan.gathered_indexer_slot_mapping, own->plan.gathered_slot_mapping);
    auto backend = make_cpu_backend(2);
    const CacheFormat& f = own->setup.fmt;
    const PublishResult ref = backend->publish(plain->setup, plain->inputs, Transport::kDirect);
    PublishResult direct;
    for (Transport tr : {Transport::kDirect, Transport::kStaging, Transport::kCollect}) {
      const std::string what = fmt::format("pcp {} {}", pcp, to_string(tr));
      const PublishResult r = backend->publish(own->setup, own->inputs, tr);
      EXPECT_EQ(r.index_geometry.num_blocks, own->plan.index_num_blocks) << what;
      EXPECT_TRUE(test::replicas_identical(r, f)) << what;
      EXPECT_TRUE(test::all_untouched(r, own->plan, f)) << what;
      if (tr == Transport::kDirect) direct = r;
      if (tr == Transport::kStaging) {
        EXPECT_TRUE(test::same_caches(direct, r, f, what + " vs direct"));
      }
      if (tr == Transport::kCollect) continue;  // collect quantizes from bf16: its own bytes
      // The MLA caches equal the one-slot plan's; the indexer rows are that plan's, relocated.
      EXPECT_TRUE(test::bytes_equal(ref.mla_alloc[0], r.mla_alloc[0], what + ": MLA cache"));
      const std::vector<int64_t>& slots = own->plan.gathered_slot_mapping;
      const std::vector<int64_t>& islots = own->plan.gathered_indexer_slot_mapping;
      for (size_t i = 0; i < slots.size(); ++i) {
        if (slots[i] < 0) continue;
        const uint8_t* a = ref.index_alloc[0].data() + ref.index_cache_offset;
        const uint8_t* b = r.index_alloc[pcp - 1].data() + r.index_cache_offset;
        ASSERT_TRUE(test::bytes_equal(a + ref.index_geometry.data_offset(slots[i]),
                                      b + r.index_geometry.data_offset(islots[i]), 128, what + ": indexer data"));
        ASSERT_TRUE(test::bytes_equal(a + ref.index_geometry.scale_offset(slots[i]),
                                      b + r.index_geometry.scale_offset(islots[i]), 4, what + ": indexer scale"));
      }
    }
  }
}

TEST(IndexSlots, PlanGivesTheIndexerItsOwnBlocksOnlyWhenAsked) {
  PlanConfig c;
  c.pcp_world = 2;
  c.block_size = 4;
  c.requests = {{RequestKind::kPrefill, 11, 0}, {RequestKind::kDecode, 1, 6}};
  c.seed = 3;
  const PcpPlan plain = make_plan(c);
  EXPECT_FALSE(plain.has_index_slots());
  EXPECT_EQ(plain.gathered_index_slots_or_null(), nullptr);
  EXPECT_EQ(plain.ranks[0].index_slots_or_null(), nullptr);
  c.own_index_blocks = true;
  c.index_extra_blocks = 5;
  const PcpPlan own = make_plan(c);
  EXPECT_EQ(own.index_num_blocks, own.num_blocks + 5);
  EXPECT_EQ(own.gathered_slot_mapping, plain.gathered_slot_mapping);
  for (size_t i = 0; i < own.gathered_slot_mapping.size(); ++i)
    EXPECT_EQ(own.gathered_indexer_slot_mapping[i] < 0, own.gathered_slot_mapping[i] < 0) << i;
  PcpPlan bad = own;
  bad.ranks[1].indexer_slot_mapping[0] = bad.ranks[1].indexer_slot_mapping[1];
  bad.gathered_indexer_slot_mapping[static_cast<size_t>(bad.max_local_tokens)] = bad.ranks[1].indexer_slot_mapping[0];
  EXPECT_NE(test::error_of([&] { validate_plan(bad); }).find("plan: rank 1 indexer_slot_mapping[0] = "),
            std::string::npos);
  // The run-time replica check hashes the same rows, each with its indexer slot (docs/spec.md 5.2;
  // tests/publish/test_replica_hash_own_index.cpp).
  EXPECT_EQ(written_slots(own), written_slots(plain));
  EXPECT_TRUE(written_index_slots(plain).empty());
  std::vector<int64_t> islots;
  for (int64_t s : own.gathered_indexer_slot_mapping)
    if (s >= 0) islots.push_back(s);
  EXPECT_EQ(written_index_slots(own), islots);
  EXPECT_EQ(written_slots(plain).size(), static_cast<size_t>(plain.num_written_slots()));
  c.index_extra_blocks = -1;
  EXPECT_NE(test::error_of([&] { make_plan(c); }).find("plan: index_extra_blocks = -1 must be >= 0"),
            std::string::npos);
}

}  // namespace
}  // namespace pcpkv
