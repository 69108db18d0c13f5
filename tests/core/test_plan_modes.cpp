// pcpkv-test-labels: unit
// Plan modes (SPEC section 4.1): the local order (request | local, vLLM's PCPManager) and decode ownership
// (replicated | round_robin, vLLM #52162): exact rows per rank, and cache bytes that do not depend on either.
#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/plan.h"
#include "support/error_of.h"
#include "support/publish_case.h"

namespace pcpkv {
namespace {

using test::error_of;

using Rows = std::vector<std::vector<int64_t>>;

constexpr LocalOrder kOrders[] = {LocalOrder::kRequest, LocalOrder::kLocal};
constexpr DecodeOwnership kOwnerships[] = {DecodeOwnership::kReplicated, DecodeOwnership::kRoundRobin};

PcpPlan plan_of(int32_t P, std::vector<RequestSpec> requests, LocalOrder order, DecodeOwnership own) {
  PlanConfig c;
  c.pcp_world = P;
  c.block_size = 16;
  c.seed = 3;
  c.requests = std::move(requests);
  c.local_order = order;
  c.decode_ownership = own;
  return make_plan(c);
}

// Each rank's real rows as global token indices, in local order.
Rows rows_of(const PcpPlan& p) {
  Rows out;
  for (const RankPlan& rp : p.ranks)
    out.emplace_back(rp.global_index.begin(), rp.global_index.begin() + rp.num_local_tokens);
  return out;
}

// Each rank's rows that carry a slot (the rows it publishes), as global token indices.
Rows written_of(const PcpPlan& p) {
  Rows out;
  for (const RankPlan& rp : p.ranks) {
    out.emplace_back();
    for (int64_t i = 0; i < rp.num_local_tokens; ++i)
      if (rp.slot_mapping[static_cast<size_t>(i)] >= 0) out.back().push_back(rp.global_index[static_cast<size_t>(i)]);
  }
  return out;
}

std::vector<int64_t> counts_of(const PcpPlan& p) {
  std::vector<int64_t> n;
  for (const RankPlan& rp : p.ranks) n.push_back(rp.num_local_tokens);
  return n;
}

TEST(PlanModes, FifteenTokensAtTwoRanks) {
  // DualChunkSwap: chunk = ceil(15 / 4) = 4; rank 0 owns [0, 4) and [12, 15), rank 1 [4, 12).
  ASSERT_EQ(dual_chunk_swap_tokens(15, 2, 0), (std::vector<int64_t>{0, 1, 2, 3, 12, 13, 14}));
  for (DecodeOwnership own : kOwnerships) {
    const PcpPlan req = plan_of(2, {{RequestKind::kPrefill, 15, 0}}, LocalOrder::kRequest, own);
    const PcpPlan loc = plan_of(2, {{RequestKind::kPrefill, 15, 0}}, LocalOrder::kLocal, own);
    EXPECT_EQ(counts_of(req), (std::vector<int64_t>{7, 8}));
    EXPECT_EQ(counts_of(loc), (std::vector<int64_t>{7, 8}));
    EXPECT_EQ(rows_of(req), (Rows{{0, 1, 2, 3, 12, 13, 14}, {4, 5, 6, 7, 8, 9, 10, 11}}));
    // local: rank 0's head chunk starts at position 0 (a "pure prefill" segment in vLLM) and goes last.
    EXPECT_EQ(rows_of(loc), (Rows{{12, 13, 14, 0, 1, 2, 3}, {4, 5, 6, 7, 8, 9, 10, 11}}));
    EXPECT_EQ(loc.ranks[0].positions[0], 12);
    EXPECT_EQ(loc.ranks[0].slot_mapping[0], loc.global_slots[12]);
    EXPECT_EQ(loc.ranks[0].slot_mapping[3], loc.global_slots[0]);
    EXPECT_EQ(loc.ranks[0].slot_mapping[7], -1);  // padding to max_local_tokens 8
  }
}

TEST(PlanModes, ThreeDecodesAtTwoRanks) {
  const std::vector<RequestSpec> decodes = {
      {RequestKind::kDecode, 1, 16}, {RequestKind::kDecode, 1, 16}, {RequestKind::kDecode, 1, 16}};
  for (LocalOrder order : kOrders) {
    const PcpPlan rr = plan_of(2, decodes, order, DecodeOwnership::kRoundRobin);
    EXPECT_EQ(rows_of(rr), (Rows{{0, 2}, {1}}));  // vLLM #52162's test: owners [[0, 2], [1]]
    EXPECT_EQ(written_of(rr), (Rows{{0, 2}, {1}}));
    EXPECT_EQ(rr.decode_owner, (std::vector<int32_t>{0, 1, 0}));
    EXPECT_EQ(rr.max_local_tokens, 2);
    EXPECT_EQ(rr.ranks[1].slot_mapping[1], -1);  // rank 1's padding row
    EXPECT_EQ(rr.ranks[0].num_decode_tokens, 2);
    EXPECT_EQ(rr.ranks[1].num_decode_tokens, 1);

    const PcpPlan rep = plan_of(2, decodes, order, DecodeOwnership::kReplicated);
    EXPECT_EQ(rows_of(rep), (Rows{{0, 1, 2}, {0, 1, 2}}));
    EXPECT_EQ(written_of(rep), (Rows{{0, 1, 2}, {}}));
    EXPECT_EQ(rep.decode_owner, (std::vector<int32_t>{0, 0, 0}));
  }
}

TEST(PlanModes, RoundRobinCountsOnlyDecodesAndLeavesRanksEmpty) {
  // vLLM's test: 18 decodes at PCP 4 -> decode i on rank i % 4, counts differ by at most one.
  std::vector<RequestSpec> d(18, {RequestKind::kDecode, 1, 16});
  const PcpPlan p = plan_of(4, d, LocalOrder::kRequest, DecodeOwnership::kRoundRobin);
  for (int32_t r = 0; r < 4; ++r) {
    std::vector<int64_t> want;
    for (int64_t i = r; i < 18; i += 4) want.push_back(i);
    EXPECT_EQ(rows_of(p)[static_cast<size_t>(r)], want) << "rank " << r;
  }
  // The index counts decodes only: a prefill between them does not shift the owners.
  const PcpPlan mixed = plan_of(2,
                                {{RequestKind::kPrefill, 8, 0},
                                 {RequestKind::kDecode, 1, 16},
                                 {RequestKind::kPrefill, 3, 5},
                                 {RequestKind::kDecode, 1, 16}},
                                LocalOrder::kRequest, DecodeOwnership::kRoundRobin);
  EXPECT_EQ(mixed.decode_owner, (std::vector<int32_t>{-1, 0, -1, 1}));
  // One decode at PCP 4: ranks 1..3 hold nothing but a padding row.
  const PcpPlan one = plan_of(4, {{RequestKind::kDecode, 1, 7}}, LocalOrder::kLocal, DecodeOwnership::kRoundRobin);
  EXPECT_EQ(counts_of(one), (std::vector<int64_t>{1, 0, 0, 0}));
  EXPECT_EQ(one.max_local_tokens, 1);
  EXPECT_EQ(one.gathered_slot_mapping, (std::vector<int64_t>{one.global_slots[0], -1, -1, -1}));
}

// Fresh prefill, decode, continued prefill (context 20), decode, fresh prefill; global tokens:
// request 0 -> 0..7, 1 -> 8, 2 -> 9..14, 3 -> 15, 4 -> 16..20.
std::vector<RequestSpec> mixed_batch() {
  return {{RequestKind::kPrefill, 8, 0},
          {RequestKind::kDecode, 1, 40},
          {RequestKind::kPrefill, 6, 20},
          {RequestKind::kDecode, 1, 3},
          {RequestKind::kPrefill, 5, 0}};
}

TEST(PlanModes, MixedBatchExactRows) {
  // P 2: request 0 (chunk 2) rank 0 [0,2) [6,8), rank 1 [2,6); request 2 (chunk 2) rank 0 [0,2), rank 1 [2,6);
  // request 4 (chunk 2) rank 0 [0,2), rank 1 [2,5).
  struct Want {
    LocalOrder order;
    DecodeOwnership own;
    Rows rows, written;
  };
  const std::vector<Want> cases = {
      {LocalOrder::kRequest, DecodeOwnership::kReplicated,
       {{0, 1, 6, 7, 8, 9, 10, 15, 16, 17}, {2, 3, 4, 5, 8, 11, 12, 13, 14, 15, 18, 19, 20}},
       {{0, 1, 6, 7, 8, 9, 10, 15, 16, 17}, {2, 3, 4, 5, 11, 12, 13, 14, 18, 19, 20}}},
      // local: segments starting at position 0 (rank 0's head chunks of requests 0 and 4) last; the continued
      // prefill's chunk (positions 20, 21) and the tail chunk (6, 7) keep their request order.
      {LocalOrder::kLocal, DecodeOwnership::kReplicated,
       {{6, 7, 8, 9, 10, 15, 0, 1, 16, 17}, {2, 3, 4, 5, 8, 11, 12, 13, 14, 15, 18, 19, 20}},
       {{6, 7, 8, 9, 10, 15, 0, 1, 16, 17}, {2, 3, 4, 5, 11, 12, 13, 14, 18, 19, 20}}},
      // round robin: decode 0 (token 8) on rank 0, decode 1 (token 15) on rank 1 only.
      {LocalOrder::kRequest, DecodeOwnership::kRoundRobin,
       {{0, 1, 6, 7, 8, 9, 10, 16, 17}, {2, 3, 4, 5, 11, 12, 13, 14, 15, 18, 19, 20}},
       {{0, 1, 6, 7, 8, 9, 10, 16, 17}, {2, 3, 4, 5, 11, 12, 13, 14, 15, 18, 19, 20}}},
      {LocalOrder::kLocal, DecodeOwnership::kRoundRobin,
       {{6, 7, 8, 9, 10, 0, 1, 16, 17}, {2, 3, 4, 5, 11, 12, 13, 14, 15, 18, 19, 20}},
       {{6, 7, 8, 9, 10, 0, 1, 16, 17}, {2, 3, 4, 5, 11, 12, 13, 14, 15, 18, 19, 20}}},
  };
  for (const Want& w : cases) {
    SCOPED_TRACE(fmt::format("{} / {}", to_string(w.order), to_string(w.own)));
    const PcpPlan p = plan_of(2, mixed_batch(), w.order, w.own);
    EXPECT_EQ(rows_of(p), w.rows);
    EXPECT_EQ(written_of(p), w.written);
    EXPECT_EQ(p.max_local_tokens, static_cast<int64_t>(std::max(w.rows[0].size(), w.rows[1].size())));
    EXPECT_EQ(p.local_order, w.order);
    EXPECT_EQ(p.decode_ownership, w.own);
    const int64_t dec = w.own == DecodeOwnership::kReplicated ? 2 : 1;
    EXPECT_EQ(p.ranks[0].num_decode_tokens, dec);
    EXPECT_EQ(p.ranks[1].num_decode_tokens, dec);
    EXPECT_EQ(p.ranks[0].num_prefill_tokens, 8);
    EXPECT_EQ(p.ranks[1].num_prefill_tokens, 11);
    for (size_t r = 0; r < 2; ++r)  // positions follow the rows
      for (size_t i = 0; i < w.rows[r].size(); ++i)
        EXPECT_EQ(p.ranks[r].positions[i], p.global_positions[static_cast<size_t>(w.rows[r][i])]);
  }
}

TEST(PlanModes, OneRankLocalOrderMovesWholeFreshPrefill) {
  // At P 1 a prefill's two chunks are one run: a fresh prefill moves last as a whole, a decode stays first.
  const PcpPlan p =
      plan_of(1, {{RequestKind::kPrefill, 5, 0}, {RequestKind::kDecode, 1, 9}, {RequestKind::kPrefill, 2, 4}},
              LocalOrder::kLocal, DecodeOwnership::kRoundRobin);
  EXPECT_EQ(rows_of(p), (Rows{{5, 6, 7, 0, 1, 2, 3, 4}}));
}

TEST(PlanModes, BadNamesNameTheFieldAndValue) {
  EXPECT_EQ(parse_local_order("request"), LocalOrder::kRequest);
  EXPECT_EQ(parse_local_order("local"), LocalOrder::kLocal);
  EXPECT_EQ(parse_decode_ownership("replicated"), DecodeOwnership::kReplicated);
  EXPECT_EQ(parse_decode_ownership("round_robin"), DecodeOwnership::kRoundRobin);
  const std::string a = error_of([] { parse_local_order("fifo", "--local-order"); });
  EXPECT_NE(a.find("--local-order: unknown local order 'fifo'; expected request or local"), std::string::npos) << a;
  const std::string b = error_of([] { parse_decode_ownership("round-robin", "--decode-owner"); });
  EXPECT_NE(b.find("--decode-owner: unknown decode ownership 'round-robin'; expected replicated or round_robin"),
            std::string::npos)
      << b;
  EXPECT_NE(error_of([] { parse_local_order(""); }).find("local_order: unknown local order ''"), std::string::npos);
}

// A huge name was quoted whole (100 KB in, a 100 KB message out): clipped (input_limits.h clip), the field and the
// expected names still in the message.
TEST(PlanModes, HugeNamesAreQuotedClipped) {
  const std::string huge(100000, 'o');
  test::expect_clipped_error(error_of([&] { parse_local_order(huge, "--local-order"); }),
                             "--local-order: unknown local order 'ooo", "expected request or local");
  test::expect_clipped_error(error_of([&] { parse_decode_ownership(huge, "--decode-ownership"); }),
                             "--decode-ownership: unknown decode ownership 'ooo", "expected replicated or round_robin");
}

TEST(PlanModes, ValidateCatchesAWrongOwner) {
  PcpPlan p = plan_of(2, mixed_batch(), LocalOrder::kRequest, DecodeOwnership::kRoundRobin);
  p.decode_owner[1] = 1;  // token 8's row (with its slot) is on rank 0
  try {
    validate_plan(p);
    FAIL() << "validate_plan accepted a decode whose slot is not on its owner";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("decode request 1, owner rank 1"), std::string::npos) << e.what();
  }
}

// The cache bytes of every replica, the guards and each global token's q_c_out do not depend on the modes
// (CPU backend, every transport).
TEST(PlanModes, PublishedBytesIdenticalAcrossModes) {
  test::CaseSpec spec;
  spec.pcp = 3;
  spec.requests = {{RequestKind::kPrefill, 2 * 3 * 13 + 5, 0},
                   {RequestKind::kDecode, 1, 40},
                   {RequestKind::kPrefill, 17, 20},
                   {RequestKind::kDecode, 1, 3},
                   {RequestKind::kDecode, 1, 77},
                   {RequestKind::kDecode, 1, 9},
                   {RequestKind::kPrefill, 11, 0}};
  spec.topk_width = 8;
  spec.alloc.base_offset = 96;
  auto backend = make_cpu_backend(2);
  for (Transport t : {Transport::kCollect, Transport::kStaging, Transport::kDirect}) {
    auto base = test::make_case(spec);
    const PublishResult want = backend->publish(base->setup, base->inputs, t);
    ASSERT_TRUE(test::replicas_identical(want, spec.fmt));
    ASSERT_TRUE(test::all_untouched(want, base->plan, spec.fmt));
    const int64_t q = base->model.q_lora_rank;
    for (LocalOrder order : kOrders) {
      for (DecodeOwnership own : kOwnerships) {
        SCOPED_TRACE(fmt::format("{} {} / {}", to_string(t), to_string(order), to_string(own)));
        test::CaseSpec s = spec;
        s.local_order = order;
        s.decode_ownership = own;
        auto c = test::make_case(s);
        ASSERT_EQ(c->inputs.kv, base->inputs.kv);  // global inputs do not depend on the modes
        if (order != LocalOrder::kRequest || own != DecodeOwnership::kReplicated) {
          ASSERT_NE(rows_of(c->plan), rows_of(base->plan));  // the mode changes the rows, not the bytes
        }
        const PublishResult got = backend->publish(c->setup, c->inputs, t);
        EXPECT_TRUE(test::same_caches(want, got, spec.fmt, "vs request / replicated"));
        // Every held row's q_c_out equals the baseline's row of the same global token.
        for (int32_t r = 0; r < spec.pcp; ++r) {
          const RankPlan& rp = c->plan.ranks[static_cast<size_t>(r)];
          for (int64_t i = 0; i < rp.num_local_tokens; ++i) {
            const int64_t g = rp.global_index[static_cast<size_t>(i)];
            int32_t br = -1;
            int64_t bi = -1;
            for (int32_t rr = 0; rr < spec.pcp && bi < 0; ++rr) {  // the baseline's rank and row of g
              const RankPlan& x = base->plan.ranks[static_cast<size_t>(rr)];
              for (int64_t j = 0; j < x.num_local_tokens; ++j)
                if (x.global_index[static_cast<size_t>(j)] == g) {
                  br = rr;
                  bi = j;
                  break;
                }
            }
            ASSERT_GE(bi, 0);
            const auto* a = got.q_c_out[static_cast<size_t>(r)].data() + i * q;
            const auto* b = want.q_c_out[static_cast<size_t>(br)].data() + bi * q;
            ASSERT_TRUE(std::equal(a, a + q, b)) << "rank " << r << " row " << i << " (global token " << g << ")";
          }
        }
      }
    }
  }
}

// Round robin can leave a rank with padding rows only (one decode at PCP 4): every backend path must still
// publish the owner's row into every replica and leave the rest untouched.
TEST(PlanModes, RanksWithOnlyPaddingRowsPublish) {
  test::CaseSpec spec;
  spec.pcp = 4;
  spec.requests = {{RequestKind::kDecode, 1, 37}};
  auto base = test::make_case(spec);
  spec.decode_ownership = DecodeOwnership::kRoundRobin;
  auto rr = test::make_case(spec);
  ASSERT_EQ(counts_of(rr->plan), (std::vector<int64_t>{1, 0, 0, 0}));
  auto backend = make_cpu_backend(2);
  for (Transport t : {Transport::kCollect, Transport::kStaging, Transport::kDirect}) {
    SCOPED_TRACE(to_string(t));
    const PublishResult want = backend->publish(base->setup, base->inputs, t);
    const PublishResult got = backend->publish(rr->setup, rr->inputs, t);
    EXPECT_TRUE(test::same_caches(want, got, spec.fmt, "round robin vs replicated"));
    EXPECT_TRUE(test::all_untouched(got, rr->plan, spec.fmt));
    EXPECT_NE(got.mla_alloc[3], std::vector<uint8_t>(got.mla_alloc[3].size(), kGuardByte));  // rank 3 got the row
  }
}

}  // namespace
}  // namespace pcpkv
