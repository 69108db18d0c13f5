// pcpkv-test-labels: unit
// PCP batch plan (SPEC section 4).
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/core/error.h"
#include "pcpkv/core/plan.h"
#include "support/error_of.h"

namespace pcpkv {
namespace {

std::vector<int64_t> chunk_ids(int64_t L, int32_t P, int32_t r) {
  const int64_t chunk = (L + 2 * P - 1) / (2 * P);
  std::vector<int64_t> ids;
  for (int64_t t : dual_chunk_swap_tokens(L, P, r)) {
    const int64_t c = t / chunk;
    if (ids.empty() || ids.back() != c) ids.push_back(c);
  }
  return ids;
}

TEST(Plan, DualChunkSwapSpecExample) {
  // SPEC section 4, P = 4: rank0 {0,7}, rank1 {1,6}, rank2 {2,5}, rank3 {3,4}.
  const std::vector<std::vector<int64_t>> expect = {{0, 7}, {1, 6}, {2, 5}, {3, 4}};
  for (int32_t r = 0; r < 4; ++r) EXPECT_EQ(chunk_ids(800, 4, r), expect[r]) << "rank " << r;
  EXPECT_EQ(dual_chunk_swap_tokens(800, 4, 0).size(), 200u);
  // Chunk lengths min(chunk, L - idx*chunk): L = 13, P = 2 -> chunk 4: [0,4) [4,8) [8,12) [12,13).
  EXPECT_EQ(dual_chunk_swap_tokens(13, 2, 0), (std::vector<int64_t>{0, 1, 2, 3, 12}));
  EXPECT_EQ(dual_chunk_swap_tokens(13, 2, 1), (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 11}));
}

PlanConfig mixed(int32_t P, int64_t L, int num_decodes, int32_t block_size = 16) {
  PlanConfig c;
  c.pcp_world = P;
  c.block_size = block_size;
  c.seed = 7;
  for (int d = 0; d < num_decodes; ++d) c.requests.push_back({RequestKind::kDecode, 1, 100 + 37 * d});
  c.requests.push_back({RequestKind::kPrefill, L, 0});
  return c;
}

TEST(Plan, EveryTokenOnceForManyWorlds) {
  for (int32_t P : {1, 2, 3, 4, 8}) {
    for (int64_t L : {1, 5, 13, 16, 13 * P, 1000, 4097}) {
      const PcpPlan p = make_plan(mixed(P, L, 3));
      std::vector<int> seen(static_cast<size_t>(p.num_global_tokens()), 0);
      int64_t max_local = 0;
      for (int32_t r = 0; r < P; ++r) {
        const RankPlan& rp = p.ranks[static_cast<size_t>(r)];
        EXPECT_EQ(rp.num_decode_tokens, 3);
        for (int64_t i = 0; i < rp.num_local_tokens; ++i) {
          const int64_t g = rp.global_index[static_cast<size_t>(i)];
          const bool decode = p.requests[static_cast<size_t>(p.global_request[static_cast<size_t>(g)])].kind ==
                              RequestKind::kDecode;
          if (!decode || r == 0) ++seen[static_cast<size_t>(g)];
          EXPECT_EQ(rp.positions[static_cast<size_t>(i)], p.global_positions[static_cast<size_t>(g)]);
          if (decode && r > 0) {
            EXPECT_EQ(rp.slot_mapping[static_cast<size_t>(i)], -1);
          }
        }
        for (int64_t i = rp.num_local_tokens; i < p.max_local_tokens; ++i) {
          EXPECT_EQ(rp.slot_mapping[static_cast<size_t>(i)], -1);
          EXPECT_EQ(rp.global_index[static_cast<size_t>(i)], -1);
        }
        max_local = std::max(max_local, rp.num_local_tokens);
      }
      EXPECT_EQ(max_local, p.max_local_tokens);
      for (int s : seen) EXPECT_EQ(s, 1) << "P=" << P << " L=" << L;
      EXPECT_EQ(p.num_written_slots(), p.num_global_tokens());
      // Head-tail balance: prefill token counts differ by at most one chunk.
      const int64_t chunk = (L + 2 * P - 1) / (2 * P);
      int64_t lo = INT64_MAX, hi = 0;
      for (const RankPlan& rp : p.ranks) {
        lo = std::min(lo, rp.num_prefill_tokens);
        hi = std::max(hi, rp.num_prefill_tokens);
      }
      EXPECT_LE(hi - lo, chunk) << "P=" << P << " L=" << L;
    }
  }
}

TEST(Plan, UnevenThirteenPerRank) {
  // 13 * P tokens: local counts differ between ranks (not a multiple of 2P), padding fills the rest.
  const PcpPlan p = make_plan(mixed(4, 13 * 4, 0));
  std::set<int64_t> counts;
  for (const RankPlan& rp : p.ranks) counts.insert(rp.num_local_tokens);
  EXPECT_GT(counts.size(), 1u);
  EXPECT_EQ(p.max_local_tokens, *counts.rbegin());
  EXPECT_EQ(p.gathered_slot_mapping.size(), static_cast<size_t>(4 * p.max_local_tokens));
}

TEST(Plan, RankWithZeroPrefillTokens) {
  // L = 3, P = 4: chunk 1, chunks 0..2 non-empty; rank 3 owns chunks 3 and 4, both empty.
  const PcpPlan p = make_plan(mixed(4, 3, 2));
  EXPECT_EQ(p.ranks[3].num_prefill_tokens, 0);
  EXPECT_EQ(p.ranks[3].num_decode_tokens, 2);
  EXPECT_EQ(p.ranks[0].num_prefill_tokens, 1);
  const PcpPlan q = make_plan(mixed(8, 5, 0));
  EXPECT_EQ(q.ranks[7].num_local_tokens, 0);
}

TEST(Plan, BlockTablesIndependentOfWorldSize) {
  const PcpPlan a = make_plan(mixed(1, 1000, 4));
  const PcpPlan b = make_plan(mixed(8, 1000, 4));
  EXPECT_EQ(a.block_tables, b.block_tables);
  EXPECT_EQ(a.global_slots, b.global_slots);
  EXPECT_EQ(a.num_blocks, b.num_blocks);
  // Null block reserved, blocks shuffled.
  for (const auto& t : a.block_tables)
    for (int32_t blk : t) EXPECT_GE(blk, 1);
  EXPECT_NE(a.block_tables.back(), [&] {
    std::vector<int32_t> sorted = a.block_tables.back();
    std::sort(sorted.begin(), sorted.end());
    return sorted;
  }());
}

TEST(Plan, SlotFormula) {
  const PcpPlan p = make_plan(mixed(2, 100, 1, 16));
  for (int64_t g = 0; g < p.num_global_tokens(); ++g) {
    const auto& table = p.block_tables[static_cast<size_t>(p.global_request[static_cast<size_t>(g)])];
    const int64_t pos = p.global_positions[static_cast<size_t>(g)];
    EXPECT_EQ(p.global_slots[static_cast<size_t>(g)], table[static_cast<size_t>(pos / 16)] * 16 + pos % 16);
  }
  EXPECT_EQ(p.global_positions[0], 100);  // the decode's position is its context length
}

std::string plan_error(const PlanConfig& c) {
  return test::error_of([&] { make_plan(c); });
}

TEST(Plan, BadConfigsNameFieldAndValue) {
  PlanConfig c = mixed(0, 10, 0);
  // Named as both callers know them: PlanConfig's field (pcpkv_torch.make_plan's argument) and the CLI's flag.
  EXPECT_NE(plan_error(c).find("pcp_world (--pcp) = 0 must be >= 1"), std::string::npos) << plan_error(c);
  c = mixed(2000, 10, 0);
  EXPECT_NE(plan_error(c).find("pcp_world (--pcp) = 2000 is larger than 1024"), std::string::npos) << plan_error(c);
  c = mixed(2, 10, 0, 48);
  EXPECT_NE(plan_error(c).find("block_size (--block-size) = 48 must be a power of two"), std::string::npos)
      << plan_error(c);
  c = mixed(2, 10, 0);
  c.requests.push_back({RequestKind::kDecode, 2, 5});
  EXPECT_NE(plan_error(c).find("num_new_tokens = 1, got 2"), std::string::npos);
  c = mixed(2, 0, 0);
  EXPECT_NE(plan_error(c).find("num_new_tokens >= 1, got 0"), std::string::npos);
  c.requests.clear();
  EXPECT_NE(plan_error(c).find("no requests"), std::string::npos);
  // Sizes that overflow int32 block ids or the position range are refused before anything is allocated.
  c = mixed(2, int64_t{1} << 33, 0, 1);
  EXPECT_NE(plan_error(c).find("block ids are int32"), std::string::npos);
  c = mixed(2, int64_t{1} << 41, 0);
  EXPECT_NE(plan_error(c).find("exceed 2^40 tokens"), std::string::npos);
}

std::string positions_error(const PcpPlan& p, int64_t max_positions, const std::string& origin = "plan") {
  return test::error_of([&] { validate_positions(p, max_positions, origin); });
}

TEST(Plan, PositionsPastTheModelNameRequestAndPosition) {
  // Decodes at 100 and 137 (requests 0, 1), then a prefill [0, 26) (request 2), over 3 ranks.
  const PcpPlan p = make_plan(mixed(3, 26, 2));
  EXPECT_EQ(positions_error(p, 138), "no error");  // the largest position, 137, is the last allowed
  const std::string last = positions_error(p, 137, "--tokens 26");
  EXPECT_NE(last.find("--tokens 26: request 1 (decode at position 137) reaches position 137"), std::string::npos)
      << last;
  EXPECT_NE(last.find("max_position_embeddings is 137 (positions must be < 137)"), std::string::npos) << last;
  // The first offending token in global order names its request: here the decode at 100 comes first.
  EXPECT_NE(positions_error(p, 26).find("request 0 (decode at position 100) reaches position 100"),
            std::string::npos);
  const PcpPlan prefill = make_plan(mixed(2, 40, 0));
  const std::string pre = positions_error(prefill, 32);
  EXPECT_NE(pre.find("plan: request 0 (prefill of 40 tokens from position 0) reaches position 32"),
            std::string::npos) << pre;
  EXPECT_NE(positions_error(prefill, 0).find("max_position_embeddings = 0 must be >= 1"), std::string::npos);
}

TEST(Plan, SlotMappingValidation) {
  const std::vector<int64_t> ok = {16, 17, -1, 40};
  EXPECT_NO_THROW(validate_slot_mapping(ok.data(), 4, 64, "slot_mapping", 16));
  auto msg = [](std::vector<int64_t> v, int64_t null_slots) {
    return test::error_of(
        [&] { validate_slot_mapping(v.data(), static_cast<int64_t>(v.size()), 64, "slot_mapping", null_slots); });
  };
  EXPECT_EQ(msg({16, 64}, 0), "slot_mapping[1] = 64 is out of range [0, 64) (or -1 to skip)");
  EXPECT_EQ(msg({16, -2}, 0), "slot_mapping[1] = -2 is out of range [0, 64) (or -1 to skip)");
  EXPECT_EQ(msg({20, 30, 20}, 0), "slot_mapping[2] = 20 duplicates slot_mapping[0]");
  EXPECT_NE(msg({3}, 16).find("null block"), std::string::npos);
}

TEST(Plan, ValidateCatchesCorruption) {
  PcpPlan p = make_plan(mixed(2, 50, 1));
  p.gathered_slot_mapping[0] = p.gathered_slot_mapping[1];
  EXPECT_THROW(validate_plan(p), Error);
  p = make_plan(mixed(2, 50, 1));
  p.ranks[1].slot_mapping[1] = p.ranks[0].slot_mapping[1];
  EXPECT_THROW(validate_plan(p), Error);
}

}  // namespace
}  // namespace pcpkv
