// pcpkv-test-labels: unit
// The verification checks (pcpkv/publish/checks.h) must catch what they claim to: a changed guard, padding or
// unwritten byte; a wrong cache value or scale; a wrong RoPE style. And pass on a correct publication.
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/publish/checks.h"
#include "support/publish_case.h"

namespace pcpkv {
namespace {

struct Published {
  std::unique_ptr<test::PublishCase> c;
  PublishResult r;
};

Published publish(const test::CaseSpec& spec, Transport t = Transport::kDirect) {
  Published p;
  p.c = test::make_case(spec);
  p.r = make_cpu_backend(2)->publish(p.c->setup, p.c->inputs, t);
  return p;
}

test::CaseSpec padded_spec() {
  test::CaseSpec spec;
  spec.pcp = 2;
  spec.requests = {{RequestKind::kPrefill, 30, 0}, {RequestKind::kDecode, 1, 12}};
  spec.extra_blocks = 2;
  spec.alloc.guard_bytes = 32;
  spec.alloc.base_offset = 96;
  spec.alloc.mla_row_pad = 16;
  spec.alloc.mla_block_pad = 32;
  spec.alloc.index_block_pad = 16;
  return spec;
}

TEST(Verify, CompareBytes) {
  std::vector<uint8_t> a(10000, 7), b = a;
  EXPECT_TRUE(compare_bytes(a, b).equal());
  EXPECT_EQ(compare_bytes(a, b).first_diff, -1);
  b[4097] = 8;
  b[9999] = 0;
  const ByteDiff d = compare_bytes(a, b);
  EXPECT_EQ(d.num_diff, 2);
  EXPECT_EQ(d.first_diff, 4097);
  b.pop_back();
  EXPECT_THROW(compare_bytes(a, b), Error);
  // Raw buffers: the same count over a prefix; against the guard byte.
  const ByteDiff raw = compare_bytes(a.data(), b.data(), 9000);
  EXPECT_EQ(raw.num_diff, 1);
  EXPECT_EQ(raw.first_diff, 4097);
  EXPECT_TRUE(compare_bytes(a.data(), b.data(), 0).equal());
  std::vector<uint8_t> g(300, kGuardByte);
  EXPECT_TRUE(compare_to_guard(g.data(), 300).equal());
  g[17] = 0;
  g[299] = 1;
  const ByteDiff gd = compare_to_guard(g.data(), 300);
  EXPECT_EQ(gd.num_diff, 2);
  EXPECT_EQ(gd.first_diff, 17);
}

TEST(Verify, UntouchedNamesTheRegionOfAChangedByte) {
  Published p = publish(padded_spec());
  const CacheFormat& fmt = p.c->setup.fmt;
  for (int32_t rank = 0; rank < 2; ++rank) {
    const GuardReport g = check_untouched(p.r, rank, p.c->plan, fmt);
    EXPECT_EQ(g.num_bad, 0) << g.first;
  }
  const MlaCacheGeometry& mg = p.r.mla_geometry;
  const IndexerCacheGeometry& ig = p.r.index_geometry;
  // An unwritten slot: block 0 is the null block.
  const int64_t written = p.c->plan.global_slots[0];
  struct Poke {
    bool mla;
    int64_t offset;
    const char* expect;
  };
  const std::vector<Poke> pokes = {
      {true, 3, "before the cache"},
      {true, p.r.mla_cache_offset - 1, "before the cache"},
      {true, p.r.mla_cache_offset + mg.bytes() + 5, "after the cache"},
      {true, p.r.mla_cache_offset + 2 * mg.row_stride + 7, "slot 2 the plan does not write"},
      {true, p.r.mla_cache_offset + mg.row_offset(written) + 656 + 3, "row padding of slot"},
      {true, p.r.mla_cache_offset + mg.block_stride - 1, "padding of block 0"},
      {false, p.r.index_cache_offset + 5 * 128 + 1, "indexer data of unwritten slot 5"},
      {false, p.r.index_cache_offset + ig.block_size * 128 + 4 * 3, "indexer scale of unwritten slot 3"},
      {false, p.r.index_cache_offset + ig.block_stride - 2, "padding of indexer block 0"},
      {false, 0, "before the cache"},
  };
  for (const Poke& k : pokes) {
    PublishResult r = p.r;
    auto& buf = k.mla ? r.mla_alloc[1] : r.index_alloc[1];
    buf[static_cast<size_t>(k.offset)] ^= 0x5a;
    const GuardReport g = check_untouched(r, 1, p.c->plan, fmt);
    EXPECT_EQ(g.num_bad, 1) << k.expect;
    EXPECT_NE(g.first.find(k.expect), std::string::npos) << "expected '" << k.expect << "' in: " << g.first;
    EXPECT_NE(g.first.find("rank 1"), std::string::npos) << g.first;
  }
  // A byte of a written row is not "untouched" territory.
  PublishResult r = p.r;
  r.mla_alloc[0][static_cast<size_t>(p.r.mla_cache_offset + mg.row_offset(written) + 5)] ^= 0x5a;
  EXPECT_EQ(check_untouched(r, 0, p.c->plan, fmt).num_bad, 0);
}

TEST(Verify, UntouchedWholeIndexerCacheOfALayerWithoutIndexer) {
  test::CaseSpec spec = padded_spec();
  spec.fmt.has_indexer = false;
  Published p = publish(spec);
  EXPECT_EQ(check_untouched(p.r, 0, p.c->plan, spec.fmt).num_bad, 0);
  p.r.index_alloc[0][p.r.index_alloc[0].size() / 2] = 0;
  const GuardReport g = check_untouched(p.r, 0, p.c->plan, spec.fmt);
  EXPECT_EQ(g.num_bad, 1);
  EXPECT_NE(g.first.find("layer without an indexer"), std::string::npos) << g.first;
}

TEST(Verify, DecodeSlotReadsTheRowBack) {
  // A hand-made fp8_ds_mla row and indexer slot.
  MlaCacheGeometry mg = dense_mla_geometry(KvFormat::kFp8DsMla, 2, 4);
  IndexerCacheGeometry ig = dense_indexer_geometry(2, 4);
  std::vector<uint8_t> mla(static_cast<size_t>(mg.bytes()), 0), idx(static_cast<size_t>(ig.bytes()), 0);
  const int64_t slot = 6;
  uint8_t* row = mla.data() + mg.row_offset(slot);
  const float scales[4] = {0.5f, 1.0f, 0.125f, 4.0f};
  for (int i = 0; i < 512; ++i) row[i] = codec::float_to_e4m3(static_cast<float>(i % 16) - 8.0f);
  std::memcpy(row + 512, scales, 16);
  for (int i = 0; i < 64; ++i) {
    const uint16_t h = codec::float_to_bf16(0.25f * static_cast<float>(i));
    std::memcpy(row + 528 + 2 * i, &h, 2);
  }
  const float s = 0.0625f;
  std::memcpy(idx.data() + ig.scale_offset(slot), &s, 4);
  for (int i = 0; i < 128; ++i) idx[static_cast<size_t>(ig.data_offset(slot) + i)] = codec::float_to_e4m3(static_cast<float>(i % 8));
  CacheFormat fmt;
  const DecodedRow d = decode_slot(mla.data(), mg, idx.data(), ig, fmt, slot);
  for (int i = 0; i < 512; ++i) ASSERT_EQ(d.kv_c[i], (static_cast<float>(i % 16) - 8.0f) * scales[i / 128]) << i;
  for (int i = 0; i < 64; ++i) ASSERT_EQ(d.k_pe[i], 0.25f * static_cast<float>(i)) << i;
  for (int i = 0; i < 128; ++i) ASSERT_EQ(d.index_k[i], static_cast<float>(i % 8) * s) << i;
  EXPECT_EQ(d.index_scale, s);
  EXPECT_EQ(d.tile_scales[3], 4.0f);
  EXPECT_THROW(decode_slot(mla.data(), mg, idx.data(), ig, fmt, 8), Error);
}

Fp8Report bound_of(const Published& p, const PublishResult& r, bool bf16_first) {
  return check_fp8_bound(r, 0, p.c->inputs, p.c->plan, p.c->model, p.c->setup.fmt, bf16_first);
}

TEST(Verify, Fp8BoundPassesAndCatchesWrongValuesAndScales) {
  Published p = publish(padded_spec());
  const Fp8Report ok = bound_of(p, p.r, false);
  EXPECT_EQ(ok.num_over_bound, 0) << ok.worst;
  EXPECT_EQ(ok.num_values, p.c->plan.num_written_slots() * (512 + 64 + 128));
  EXPECT_GT(ok.max_err_over_bound, 0.1) << "the bound should not be loose by an order of magnitude";

  const int64_t slot = p.c->plan.global_slots[5];
  const int64_t row = p.r.mla_cache_offset + p.r.mla_geometry.row_offset(slot);
  {  // one kv_c byte off by a few e4m3 steps
    PublishResult r = p.r;
    r.mla_alloc[0][static_cast<size_t>(row + 130)] ^= 0x04;
    const Fp8Report f = bound_of(p, r, false);
    EXPECT_EQ(f.num_over_bound, 1);
    EXPECT_NE(f.worst.find("kv_c[130]"), std::string::npos) << f.worst;
    EXPECT_NE(f.worst.find(fmt::format("slot {}", slot)), std::string::npos) << f.worst;
  }
  {  // a tile scale doubled: the scale check and the tile's values both fail
    PublishResult r = p.r;
    float s;
    std::memcpy(&s, r.mla_alloc[0].data() + row + 512 + 8, 4);
    s *= 4.0f;
    std::memcpy(r.mla_alloc[0].data() + row + 512 + 8, &s, 4);
    const Fp8Report f = bound_of(p, r, false);
    EXPECT_GT(f.num_over_bound, 1);
  }
  {  // an indexer value
    PublishResult r = p.r;
    r.index_alloc[0][static_cast<size_t>(p.r.index_cache_offset + p.r.index_geometry.data_offset(slot) + 9)] ^= 0x10;
    const Fp8Report f = bound_of(p, r, false);
    EXPECT_GE(f.num_over_bound, 1);
    EXPECT_NE(f.worst.find("index_k[9]"), std::string::npos) << f.worst;
  }
}

TEST(Verify, Fp8BoundCatchesTheWrongRopeStyle) {
  test::CaseSpec spec = padded_spec();
  Published p = publish(spec);
  // Publish with the indexer rope style flipped and check against the true model.
  auto wrong = test::make_case(spec);
  wrong->model.indexer_rope_interleave = !wrong->model.indexer_rope_interleave;
  const PublishResult r = make_cpu_backend(2)->publish(wrong->setup, wrong->inputs, Transport::kDirect);
  const Fp8Report f = bound_of(p, r, false);
  EXPECT_GT(f.num_over_bound, 100) << "a wrong RoPE style must be caught";
  EXPECT_NE(f.worst.find("index_k"), std::string::npos) << f.worst;
}

TEST(Verify, CollectNeedsTheBf16Allowance) {
  Published p = publish(padded_spec(), Transport::kCollect);
  const Fp8Report f = bound_of(p, p.r, true);
  EXPECT_EQ(f.num_over_bound, 0) << f.worst;
}

}  // namespace
}  // namespace pcpkv
