// pcpkv-test-labels: unit
// The dispatch's top-k fill modes (pcpkv/publish/dispatch.h TopkFill) on the CPU oracle: after the dispatch and pcpkv's
// indexer top-k the buffer is byte-identical under full and tail (the case: tests/support/topk_fill_case.h), each
// mode writes exactly its rows, bad parameters are refused before anything is written, and the CPU backend
// fills each rank's padding rows only under tail.
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/core/error.h"
#include "support/error_of.h"
#include "support/publish_case.h"
#include "support/topk_fill_case.h"

namespace pcpkv {
namespace {

using test::TopkFillCase;
constexpr int64_t kN = TopkFillCase::kIndexerRows, kT = TopkFillCase::kRows, kK = TopkFillCase::kTopk;

std::vector<int32_t> run_dispatch(TopkFillCase& c, TopkFill mode, int64_t indexer_rows) {
  std::vector<int32_t> topk = TopkFillCase::poisoned();
  std::vector<uint16_t> index_k_out(kT * 128, 0xA5A5);
  dispatch_reference(c.dispatch(mode, indexer_rows, topk.data(), c.kv.data(), c.k_pe.data(), c.index_k.data(),
                          c.positions.data(), c.kv_w.data(), c.ln_w.data(), c.ln_b.data(), c.rope.cos_sin.data(),
                          index_k_out.data()),
               2);
  return topk;
}

/// Rows [0, first) all kPoison, rows [first, T) all -1.
::testing::AssertionResult filled_from(const std::vector<int32_t>& topk, int64_t first, const std::string& what) {
  for (int64_t i = 0; i < kT * kK; ++i) {
    const int32_t want = i / kK < first ? static_cast<int32_t>(TopkFillCase::kPoison) : -1;
    if (topk[static_cast<size_t>(i)] != want)
      return ::testing::AssertionFailure() << what << ": row " << i / kK << " entry " << i % kK << " is "
                                           << topk[static_cast<size_t>(i)] << ", want " << want;
  }
  return ::testing::AssertionSuccess();
}

TEST(TopkFill, EachModeWritesExactlyItsRows) {
  TopkFillCase c;
  EXPECT_TRUE(filled_from(run_dispatch(c, TopkFill::kFull, kN), 0, "full"));
  EXPECT_TRUE(filled_from(run_dispatch(c, TopkFill::kTail, kN), kN, "tail"));
  EXPECT_TRUE(filled_from(run_dispatch(c, TopkFill::kTail, 0), 0, "tail, indexer on no row"));
  EXPECT_TRUE(filled_from(run_dispatch(c, TopkFill::kTail, kT), kT, "tail, indexer on every row"));
  EXPECT_TRUE(filled_from(run_dispatch(c, TopkFill::kNone, kN), kT, "none"));
  EXPECT_EQ(topk_fill_first_row(TopkFill::kTail, 5, 9), 5);
  EXPECT_EQ(topk_fill_first_row(TopkFill::kNone, 5, 9), 9);
  EXPECT_EQ(topk_fill_first_row(TopkFill::kFull, 5, 9), 0);
}

// The contract of issue 17 item 1: dispatch (tail) + indexer == dispatch (full) + indexer, byte for byte, on a
// poisoned buffer; requests shorter and longer than topk, decodes, a request -1 row and padding rows.
TEST(TopkFill, TailPlusIndexerEqualsFullPlusIndexer) {
  TopkFillCase c;
  std::vector<int32_t> full = run_dispatch(c, TopkFill::kFull, kN);
  indexer_reference(c.indexer(full.data()));
  std::vector<int32_t> tail = run_dispatch(c, TopkFill::kTail, kN);
  indexer_reference(c.indexer(tail.data()));
  ASSERT_EQ(0, std::memcmp(full.data(), tail.data(), full.size() * 4)) << "tail + indexer differs from full + indexer";
  // The case means something: the indexer wrote slots and -1 tails, and the padding rows are the fill's.
  int64_t slots = 0, minus_one = 0;
  for (int64_t i = 0; i < kN * kK; ++i) (full[static_cast<size_t>(i)] >= 0 ? slots : minus_one) += 1;
  // min(topk, position + 1) keys per row: positions 4..9, 8 rows past topk, the decodes at 50 and 5
  EXPECT_EQ(slots, (5 + 6 + 7 + 8 + 9 + 10) + 8 * kK + kK + 6);
  EXPECT_GT(minus_one, kK);  // short rows' tails and the request -1 row
  for (int64_t i = kN * kK; i < kT * kK; ++i) ASSERT_EQ(full[static_cast<size_t>(i)], -1);
  // none leaves the padding rows to nobody: not exact here (the test can tell the modes apart).
  std::vector<int32_t> none = run_dispatch(c, TopkFill::kNone, kN);
  indexer_reference(c.indexer(none.data()));
  EXPECT_NE(0, std::memcmp(full.data(), none.data(), full.size() * 4));
  EXPECT_EQ(0, std::memcmp(full.data(), none.data(), kN * kK * 4)) << "the indexer's rows do not depend on the fill";
}

TEST(TopkFill, BadParametersAreRefusedBeforeAnyWrite) {
  TopkFillCase c;
  std::vector<int32_t> topk = TopkFillCase::poisoned();
  std::vector<uint16_t> out(kT * 128, 0xA5A5);
  auto params = [&](TopkFill mode, int64_t rows) {
    return c.dispatch(mode, rows, topk.data(), c.kv.data(), c.k_pe.data(), c.index_k.data(), c.positions.data(),
                      c.kv_w.data(), c.ln_w.data(), c.ln_b.data(), c.rope.cos_sin.data(), out.data());
  };
  auto expect_error = [&](const DispatchParams& p, const std::string& part) {
    try {
      dispatch_reference(p);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error(params(TopkFill::kTail, -1), "topk_indexer_rows = -1 must be in [0, num_tokens = 22]");
  expect_error(params(TopkFill::kTail, kT + 1), "topk_indexer_rows = 23");
  expect_error(params(static_cast<TopkFill>(7), 0), "topk_fill_mode = 7 is not a TopkFill");
  EXPECT_TRUE(filled_from(topk, kT, "after the refused calls"));
  for (uint16_t v : out) ASSERT_EQ(v, 0xA5A5);
  // A mode other than tail ignores topk_indexer_rows.
  EXPECT_NO_THROW(dispatch_reference(params(TopkFill::kFull, -5)));

  EXPECT_EQ(parse_topk_fill("tail", "--topk-fill"), TopkFill::kTail);
  EXPECT_EQ(parse_topk_fill("full", "x"), TopkFill::kFull);
  EXPECT_EQ(parse_topk_fill("none", "x"), TopkFill::kNone);
  try {
    parse_topk_fill("Tail", "--topk-fill");
    ADD_FAILURE() << "accepted 'Tail'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--topk-fill: 'Tail' is not a top-k fill; known: full, tail, none"),
              std::string::npos)
        << e.what();
  }
  // A huge value is clipped (input_limits.h clip), not quoted whole; the field and the known names still follow.
  test::expect_clipped_error(test::error_of([] { parse_topk_fill(std::string(100000, 't'), "--topk-fill"); }),
                             "--topk-fill: 'ttt", "is not a top-k fill; known: full, tail, none");
}

// The CPU backend (every transport): full fills every row of every rank, tail only each rank's padding rows
// [num_local_tokens, max_local_tokens), none nothing; the rest keeps kGuardByte. The byte model follows.
TEST(TopkFill, CpuBackendFillsEachRanksPaddingRowsUnderTail) {
  test::CaseSpec spec;
  spec.pcp = 4;
  spec.requests = {{RequestKind::kPrefill, 13 * 8 + 5, 0}, {RequestKind::kDecode, 1, 40},
                   {RequestKind::kPrefill, 7, 20}};
  spec.topk_width = 24;
  auto c = test::make_case(spec);
  const PcpPlan& plan = c->plan;
  const int64_t M = plan.max_local_tokens, W = plan.pcp_world;
  int64_t padding = 0;
  for (const RankPlan& rp : plan.ranks) padding += M - rp.num_local_tokens;
  ASSERT_GT(padding, 0) << "the case needs padding rows";
  auto cpu = make_cpu_backend(2);
  for (TopkFill mode : {TopkFill::kFull, TopkFill::kTail, TopkFill::kNone})
    for (Transport t : {Transport::kCollect, Transport::kStaging, Transport::kDirect}) {
      const std::string what = fmt::format("{} {}", to_string(mode), to_string(t));
      c->setup.topk_fill_mode = mode;
      const PublishResult r = cpu->publish(c->setup, c->inputs, t);
      ASSERT_EQ(static_cast<int64_t>(r.topk.size()), W) << what;
      for (int32_t rank = 0; rank < W; ++rank) {
        const int64_t first = topk_fill_first_row(mode, plan.ranks[static_cast<size_t>(rank)].num_local_tokens, M);
        const auto& buf = r.topk[static_cast<size_t>(rank)];
        ASSERT_EQ(static_cast<int64_t>(buf.size()), M * spec.topk_width) << what;
        for (int64_t i = 0; i < M * spec.topk_width; ++i) {
          uint32_t poison;
          std::memset(&poison, kGuardByte, 4);
          const int32_t want = i / spec.topk_width < first ? static_cast<int32_t>(poison) : -1;
          ASSERT_EQ(buf[static_cast<size_t>(i)], want) << what << " rank " << rank << " row " << i / spec.topk_width;
        }
      }
      int64_t dispatch_bytes = 0;
      for (const Stage& s : r.profile.stages)
        if (s.name == "dispatch" || s.name == "topk-fill") dispatch_bytes += s.bytes;  // the fill is its own step
      c->setup.topk_fill_mode = TopkFill::kNone;
      const PublishResult none = cpu->publish(c->setup, c->inputs, t);
      int64_t none_bytes = 0;
      for (const Stage& s : none.profile.stages)
        if (s.name == "dispatch" || s.name == "topk-fill") none_bytes += s.bytes;
      const int64_t rows = mode == TopkFill::kFull ? W * M : mode == TopkFill::kTail ? padding : 0;
      EXPECT_EQ(dispatch_bytes - none_bytes, rows * spec.topk_width * 4) << what << ": byte model of the fill";
    }
}

}  // namespace
}  // namespace pcpkv
