// pcpkv-test-labels: unit
// The publication checks as `pcpkv run` and `pcpkv mp-publish` apply them (pcpkv/publish/checks.h): each
// passes on a correct CPU publication, each fails on the corruption it is for, naming the place, and the
// JSON shape keeps the keys readers use.
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/checks.h"
#include "support/publish_case.h"

namespace pcpkv {
namespace {

struct Published {
  std::unique_ptr<test::PublishCase> c;
  PcpPlan single_plan;
  PublishResult r, single;
  PublicationCase pc() const {
    PublicationCase p;
    p.model = &c->model;
    p.plan = &c->plan;
    p.inputs = &c->inputs;
    p.fmt = c->setup.fmt;
    p.topk_width = c->setup.topk_width;
    return p;
  }
};

Published publish(Transport t, int64_t topk_width = 0) {
  test::CaseSpec spec;
  spec.pcp = 3;
  spec.requests = {{RequestKind::kPrefill, 40, 0}, {RequestKind::kDecode, 1, 20}};
  spec.alloc.guard_bytes = 32;
  spec.topk_width = topk_width;
  Published run;
  run.c = test::make_case(spec);
  run.c->setup.materialize_q = true;
  auto cpu = make_cpu_backend(2);
  run.r = cpu->publish(run.c->setup, run.c->inputs, t);
  run.single_plan = single_rank_plan(run.c->plan);
  PublishSetup s = run.c->setup;
  s.plan = &run.single_plan;
  s.topk_width = 0;
  run.single = cpu->publish(s, run.c->inputs, t);
  return run;
}

std::vector<std::string> names(const std::vector<Check>& checks) {
  std::vector<std::string> v;
  for (const Check& c : checks) v.push_back(c.name);
  return v;
}

TEST(PublicationChecks, PassOnACorrectPublicationInOrder) {
  const Published run = publish(Transport::kStaging, 16);
  std::vector<std::string> steps;
  const std::vector<Check> checks =
      check_publication(run.r, run.single, run.pc(), [&](const std::string& s) { steps.push_back(s); });
  EXPECT_EQ(names(checks), (std::vector<std::string>{"replicas identical", "== single-rank reference",
                                                     "guard/untouched bytes intact",
                                                     "dequantized vs fp64 within the FP8 bound",
                                                     "top-k buffer filled with -1 (full)"}));
  EXPECT_EQ(steps, (std::vector<std::string>{"replicas", "single-rank reference", "guard bytes",
                                             "dequantized cache vs fp64"}));
  for (const Check& c : checks) {
    EXPECT_TRUE(c.pass) << c.name << ": " << c.detail;
    EXPECT_EQ(c.transport, "staging");
  }
  EXPECT_TRUE(all_pass(checks));
  EXPECT_FALSE(all_pass({}));
  EXPECT_GT(checks[0].num_bytes, 0);
  EXPECT_GT(checks[3].num_values, 0);
}

TEST(PublicationChecks, AFlippedRowByteFailsReplicasAndReferenceNamingTheSlot) {
  Published run = publish(Transport::kDirect);
  const int64_t slot = run.c->plan.global_slots[0];
  uint8_t& flipped =
      run.r.mla_alloc[2][static_cast<size_t>(run.r.mla_cache_offset + run.r.mla_geometry.row_offset(slot) + 3)];
  const uint8_t was = flipped;
  flipped ^= 0x10;
  const std::vector<Check> checks = check_publication(run.r, run.single, run.pc());
  EXPECT_FALSE(all_pass(checks));
  EXPECT_FALSE(checks[0].pass);
  EXPECT_EQ(checks[0].num_diff, 1);
  EXPECT_NE(checks[0].detail.find("rank 2 MLA vs rank 0"), std::string::npos) << checks[0].detail;
  // The place (slot, row byte, field of the fp8_ds_mla row) and both values, this replica's first.
  EXPECT_NE(checks[0].detail.find(fmt::format("slot {}, byte 3 of its row: kv_c[3], tile 0", slot)), std::string::npos)
      << checks[0].detail;
  EXPECT_NE(checks[0].detail.find(fmt::format(": 0x{:02x} vs 0x{:02x}", was ^ 0x10, was)), std::string::npos)
      << checks[0].detail;
  EXPECT_TRUE(checks[1].pass) << "rank 0 is intact: " << checks[1].detail;
  EXPECT_TRUE(checks[2].pass) << "a row byte is not a guard byte: " << checks[2].detail;

  // The same publication against a reference of every rank (mp-publish): global rank names.
  const Check vs =
      check_replicas_vs_reference(run.r, publish(Transport::kDirect).r, run.c->setup.fmt, {10, 11, 12});
  EXPECT_FALSE(vs.pass);
  EXPECT_NE(vs.detail.find("global rank 12's MLA replica: 1 bytes differ"), std::string::npos) << vs.detail;
}

TEST(PublicationChecks, DescribeNamesTheFieldOfEveryLayout) {
  // 2 blocks of 4 rows, rows of stride 672 (656 + 16 padding), 32 bytes of block padding, the cache at byte 100.
  PublishResult r;
  r.mla_geometry = {2, 4, 672, 4 * 672 + 32};
  r.index_geometry = {2, 4, 4 * kIndexerSlotBytes + 16};
  r.mla_cache_offset = r.index_cache_offset = 100;
  CacheFormat ds, fp8, bf16;
  fp8.kv_format = KvFormat::kFp8;
  bf16.kv_format = KvFormat::kBf16;
  const int64_t slot5 = 100 + r.mla_geometry.row_offset(5);  // block 1 row 1
  EXPECT_EQ(describe_mla_byte(r, ds, slot5 + 130), fmt::format("byte {} (slot 5, byte 130 of its row: kv_c[130], "
                                                               "tile 1; block 1 row 1)", slot5 + 130));
  EXPECT_NE(describe_mla_byte(r, ds, slot5 + 517).find("byte 517 of its row: tile 1 scale, byte 1;"),
            std::string::npos);
  EXPECT_NE(describe_mla_byte(r, ds, slot5 + 531).find("k_pe[1] (bf16)"), std::string::npos);
  EXPECT_NE(describe_mla_byte(r, ds, slot5 + 660).find("byte 660 of its row: row padding"), std::string::npos);
  EXPECT_NE(describe_mla_byte(r, fp8, slot5 + 513).find("k_pe[1];"), std::string::npos);
  PublishResult wide = r;  // bf16 rows: 1152 bytes
  wide.mla_geometry = {2, 4, 1152, 4 * 1152};
  EXPECT_NE(describe_mla_byte(wide, bf16, 100 + 7).find("kv_c[3] (bf16);"), std::string::npos);
  EXPECT_NE(describe_mla_byte(wide, bf16, 100 + 1027).find("k_pe[1] (bf16);"), std::string::npos);
  EXPECT_NE(describe_mla_byte(r, ds, 100 + 4 * 672 + 3).find("(block 0 padding)"), std::string::npos);
  EXPECT_NE(describe_mla_byte(r, ds, 99).find("(before the cache)"), std::string::npos);
  EXPECT_NE(describe_mla_byte(r, ds, 100 + r.mla_geometry.bytes()).find("(after the cache)"), std::string::npos);
  const int64_t iblock1 = 100 + r.index_geometry.block_stride;
  EXPECT_EQ(describe_index_byte(r, iblock1 + 128 + 7), fmt::format("byte {} (slot 5 data, byte 7)", iblock1 + 135));
  EXPECT_EQ(describe_index_byte(r, iblock1 + 512 + 4 + 2),
            fmt::format("byte {} (slot 5 scale, byte 2)", iblock1 + 518));
  EXPECT_NE(describe_index_byte(r, iblock1 + 4 * kIndexerSlotBytes).find("(block 1 padding)"), std::string::npos);
}

TEST(PublicationChecks, AChangedGuardByteFailsTheGuardCheckOnly) {
  Published run = publish(Transport::kCollect);
  run.r.mla_alloc[1][0] ^= 0x01;
  const Check g = check_guards(run.r, run.c->plan, run.c->setup.fmt, {4, 5, 6});
  EXPECT_FALSE(g.pass);
  EXPECT_EQ(g.num_diff, 1);
  EXPECT_EQ(g.detail.rfind("global rank 5: 1 bytes changed; first: rank 1 mla_alloc byte 0", 0), 0u) << g.detail;
  EXPECT_TRUE(check_guards(publish(Transport::kCollect).r, run.c->plan, run.c->setup.fmt).pass);
}

TEST(PublicationChecks, SameCachesFingerprintsOutputsAndEpochs) {
  const Published a = publish(Transport::kStaging), b = publish(Transport::kDirect);
  EXPECT_TRUE(check_same_caches(a.r, b.r, a.c->setup.fmt, "staging == direct", "").pass);
  EXPECT_EQ(replicas_fingerprint(a.r), replicas_fingerprint(b.r));
  EXPECT_TRUE(check_same_fingerprint("staging == direct", 7, 7).pass);
  PublishResult c = b.r;
  c.index_alloc[0][static_cast<size_t>(c.index_cache_offset)] ^= 0x04;
  EXPECT_FALSE(check_same_caches(a.r, c, a.c->setup.fmt, "staging == direct", "").pass);
  EXPECT_NE(replicas_fingerprint(a.r), replicas_fingerprint(c));
  EXPECT_FALSE(check_same_fingerprint("x", replicas_fingerprint(a.r), replicas_fingerprint(c)).pass);

  EXPECT_TRUE(check_outputs_vs_reference(a.r.q_c_out[1], {}, b.r, 1).pass);
  std::vector<uint16_t> q = a.r.q_c_out[1];
  q[5] ^= 1;
  const Check out = check_outputs_vs_reference(q, {}, b.r, 1);
  EXPECT_FALSE(out.pass);
  EXPECT_EQ(out.name, "rank 1 q_c_out / top-k == reference");
  EXPECT_TRUE(check_outputs_vs_reference({}, {}, b.r, 0).pass);  // nothing to compare

  EXPECT_TRUE(check_fence_epochs({3, 3}, {6, 6}, 2).pass);   // 2 replays + the eager run
  EXPECT_TRUE(check_fence_epochs({3, 3}, {6, 3}, 2).pass);   // collect over NCCL: no publication fence
  EXPECT_FALSE(check_fence_epochs({3, 3}, {5, 5}, 2).pass);  // one replay did not fence
  EXPECT_FALSE(check_fence_epochs({3}, {6, 6}, 2).pass);
}

TEST(PublicationChecks, JsonShapeKeepsTheKeysOfPcpkvRun) {
  const Published run = publish(Transport::kDirect);
  const std::vector<Check> checks = check_publication(run.r, run.single, run.pc());
  const auto j = nlohmann::json::parse(checks_json(checks));
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), checks.size());
  for (const auto& c : j)
    for (const char* key : {"check", "transport", "pass", "detail"}) EXPECT_TRUE(c.contains(key)) << key;
  EXPECT_EQ(j[0]["check"], "replicas identical");
  EXPECT_EQ(j[0]["num_bytes"], checks[0].num_bytes);
  EXPECT_EQ(j[0]["num_diff"], 0);
  EXPECT_FALSE(j[0].contains("num_values"));
  EXPECT_EQ(j[3]["num_values"], checks[3].num_values);
  for (const char* key : {"num_over_bound", "num_saturated", "num_flushed", "max_abs_err", "max_err_over_bound", "worst"})
    EXPECT_TRUE(j[3].contains(key)) << key;
  EXPECT_FALSE(j[3].contains("num_bytes"));
  EXPECT_EQ(checks_json({}), "[]");
}

TEST(PublicationChecks, NotesOnSaturatedAndFlushedValues) {
  Check c;
  c.transport = "direct";
  c.num_values = 1000;
  c.num_saturated = 10;  // exactly 1%: no note
  EXPECT_TRUE(check_notes({c}, 0.5f).empty());
  c.num_saturated = 11;
  c.num_flushed = 50;
  const auto notes = check_notes({c}, 0.5f);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_NE(notes[0].find("saturate at 448 * k_scale (direct 11 of 1000)"), std::string::npos) << notes[0];
  EXPECT_NE(notes[0].find("--k-scale 0.5 is small"), std::string::npos) << notes[0];
  EXPECT_NE(notes[1].find("encode as 0 (direct 50 of 1000)"), std::string::npos) << notes[1];
}

}  // namespace
}  // namespace pcpkv
