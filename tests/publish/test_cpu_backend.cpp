// pcpkv-test-labels: unit
// The CPU reference backend end to end (SPEC sections 4, 5): every replica byte-identical with its guards,
// padding and unwritten slots untouched; staging == direct; each transport == its PCP-1 reference; collect
// within the bf16-first bound; bad input rejected before anything is written.
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/core/error.h"
#include "pcpkv/publish/checks.h"
#include "support/bytes.h"
#include "support/error_of.h"
#include "support/param_names.h"
#include "support/publish_case.h"

namespace pcpkv {
namespace {

using test::CaseSpec;
using test::make_case;

constexpr Transport kTransports[] = {Transport::kCollect, Transport::kStaging, Transport::kDirect};

// Uneven lengths (13 tokens per rank plus a remainder), decodes, a second prefill with context.
std::vector<RequestSpec> mixed_requests(int32_t pcp) {
  return {{RequestKind::kPrefill, 13 * 2 * pcp + 5, 0},
          {RequestKind::kDecode, 1, 40},
          {RequestKind::kPrefill, 7, 20},
          {RequestKind::kDecode, 1, 3}};
}

AllocationOptions padded_alloc() {
  AllocationOptions a;
  a.guard_bytes = 64;
  a.base_offset = 4096 + 48;  // the cache starts inside a shared allocation
  a.mla_row_pad = 16;
  a.mla_block_pad = 48;
  a.index_block_pad = 32;
  return a;
}

Fp8Report bound(const PublishResult& r, int32_t rank, const test::PublishCase& c, bool bf16_first) {
  return check_fp8_bound(r, rank, c.inputs, c.plan, c.model, c.setup.fmt, bf16_first);
}

void expect_bound_ok(const Fp8Report& f, const std::string& what) {
  EXPECT_GT(f.num_values, 0) << what;
  EXPECT_EQ(f.num_over_bound, 0) << what << ": max err/bound " << f.max_err_over_bound << ", worst " << f.worst;
  EXPECT_LE(f.max_err_over_bound, 1.0) << what;
}

class CpuBackendPcp : public ::testing::TestWithParam<int32_t> {};

TEST_P(CpuBackendPcp, ReplicasIdenticalGuardsIntactAndEqualToSingleRank) {
  const int32_t P = GetParam();
  CaseSpec spec;
  spec.pcp = P;
  spec.requests = mixed_requests(P);
  spec.alloc = padded_alloc();
  spec.topk_width = 16;
  auto c = make_case(spec);
  CaseSpec ref_spec = spec;
  ref_spec.pcp = 1;
  auto ref = make_case(ref_spec);
  ASSERT_EQ(ref->plan.global_slots, c->plan.global_slots) << "PCP-1 and PCP-P plans must share slots";

  auto backend = make_cpu_backend(2);
  std::vector<PublishResult> results;
  for (Transport t : kTransports) {
    SCOPED_TRACE(fmt::format("PCP {} {}", P, to_string(t)));
    PublishResult r = backend->publish(c->setup, c->inputs, t);
    const PublishResult r1 = backend->publish(ref->setup, ref->inputs, t);
    ASSERT_EQ(static_cast<int32_t>(r.mla_alloc.size()), P);
    EXPECT_TRUE(test::replicas_identical(r, spec.fmt));
    EXPECT_TRUE(test::all_untouched(r, c->plan, spec.fmt));
    // Rank 0's allocations equal the single-rank reference's (same plan slots, same geometry), so with the
    // replicas identical every rank's do; and every rank's q_c_out rows equal the PCP-1 rows of their tokens.
    ASSERT_EQ(r.q_c_out.size(), static_cast<size_t>(P));
    ASSERT_EQ(r1.q_c_out.size(), 1u);
    EXPECT_TRUE(test::passed(check_vs_single_rank(r, r1, c->plan, spec.fmt, c->model.q_lora_rank)));
    expect_bound_ok(bound(r, P - 1, *c, t == Transport::kCollect), "fp8 bound");
    // The top-k fill: every row of every rank -1.
    ASSERT_EQ(r.topk.size(), static_cast<size_t>(P));
    EXPECT_TRUE(test::passed(check_topk_filled(r, c->plan, spec.topk_width, TopkFill::kFull)));
    // topk-fill (topk_width 16 on an indexer layer), dispatch, then 2 (collect, staging) or 1 (direct) stages.
    ASSERT_EQ(r.profile.stages.size(), t == Transport::kDirect ? 3u : 4u);
    for (const Stage& s : r.profile.stages) {
      EXPECT_GE(s.ms, 0.0) << s.name;
      EXPECT_GT(s.bytes, 0) << s.name;
    }
    results.push_back(std::move(r));
  }
  // staging == direct byte for byte; collect differs (bf16 first) but stays within its bound (above).
  EXPECT_TRUE(test::same_caches(results[2], results[1], spec.fmt, "staging vs direct"));
  EXPECT_FALSE(compare_bytes(results[0].mla_alloc[0], results[2].mla_alloc[0]).equal())
      << "collect quantizes from bf16 and should differ from the fused path somewhere";
}

INSTANTIATE_TEST_SUITE_P(Pcp, CpuBackendPcp, ::testing::Values(1, 2, 4, 8), ::testing::PrintToStringParamName());

struct FormatCase {
  KvFormat kv;
  DsMlaScale scale;
  bool indexer;
  float k_scale;
};

class CpuBackendFormats : public ::testing::TestWithParam<FormatCase> {};

TEST_P(CpuBackendFormats, AllTransportsWithinBoundAndStagingEqualsDirect) {
  const FormatCase fc = GetParam();
  CaseSpec spec;
  spec.pcp = 4;
  spec.requests = mixed_requests(4);
  spec.fmt.kv_format = fc.kv;
  spec.fmt.ds_mla_scale = fc.scale;
  spec.fmt.has_indexer = fc.indexer;
  spec.fmt.k_scale = fc.k_scale;
  spec.alloc = padded_alloc();
  spec.topk_width = 8;
  auto c = make_case(spec);
  auto backend = make_cpu_backend(2);
  const PublishResult collect = backend->publish(c->setup, c->inputs, Transport::kCollect);
  const PublishResult staging = backend->publish(c->setup, c->inputs, Transport::kStaging);
  const PublishResult direct = backend->publish(c->setup, c->inputs, Transport::kDirect);
  EXPECT_TRUE(test::same_caches(direct, staging, spec.fmt, "staging vs direct"));
  for (const PublishResult* r : {&collect, &staging, &direct}) {
    SCOPED_TRACE(to_string(r->transport));
    EXPECT_TRUE(test::replicas_identical(*r, spec.fmt));
    EXPECT_TRUE(test::all_untouched(*r, c->plan, spec.fmt));
    const Fp8Report f = bound(*r, 0, *c, r->transport == Transport::kCollect);
    expect_bound_ok(f, to_string(r->transport));
    if (fc.kv == KvFormat::kFp8 && fc.k_scale < 0.01f) {
      EXPECT_GT(f.num_saturated, 0) << "k_scale chosen to saturate";
    }
    if (!fc.indexer) {
      EXPECT_TRUE(r->topk.empty()) << "a layer without an indexer keeps the previous top-k";
    }
  }
  // bf16 MLA rows: quantizing from bf16 changes nothing, so collect == direct there (the indexer stays fp8).
  if (fc.kv == KvFormat::kBf16) {
    for (size_t r = 0; r < direct.mla_alloc.size(); ++r)
      EXPECT_TRUE(test::bytes_equal(direct.mla_alloc[r], collect.mla_alloc[r], "bf16 MLA: collect vs direct",
                                    [&](int64_t o) { return describe_mla_byte(direct, spec.fmt, o); }));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, CpuBackendFormats,
                         ::testing::Values(FormatCase{KvFormat::kFp8DsMla, DsMlaScale::kPow2, true, 1.0f},
                                           FormatCase{KvFormat::kFp8DsMla, DsMlaScale::kRaw, true, 1.0f},
                                           FormatCase{KvFormat::kFp8, DsMlaScale::kPow2, true, 0.02f},
                                           FormatCase{KvFormat::kFp8, DsMlaScale::kPow2, true, 0.004f},
                                           FormatCase{KvFormat::kBf16, DsMlaScale::kPow2, true, 1.0f},
                                           FormatCase{KvFormat::kFp8DsMla, DsMlaScale::kPow2, false, 1.0f},
                                           FormatCase{KvFormat::kFp8, DsMlaScale::kPow2, false, 0.02f}),
                         [](const ::testing::TestParamInfo<FormatCase>& info) {
                           const FormatCase& c = info.param;
                           return test::format_case_name(c.kv, c.scale, c.indexer, c.k_scale);
                         });

PublishResult run_and_check(const CaseSpec& spec, Transport t) {
  auto c = make_case(spec);
  auto ref_spec = spec;
  ref_spec.pcp = 1;
  auto ref = make_case(ref_spec);
  auto backend = make_cpu_backend(2);
  PublishResult r = backend->publish(c->setup, c->inputs, t);
  const PublishResult r1 = backend->publish(ref->setup, ref->inputs, t);
  EXPECT_EQ(ref->plan.global_slots, c->plan.global_slots) << "PCP-1 and PCP-P plans must share slots";
  EXPECT_TRUE(test::replicas_identical(r, spec.fmt));
  EXPECT_TRUE(test::all_untouched(r, c->plan, spec.fmt));
  // Rank 0's allocations (so, the replicas identical, every rank's) equal the PCP-1 run's, q_c_out rows too.
  EXPECT_TRUE(test::passed(check_vs_single_rank(r, r1, c->plan, spec.fmt, c->model.q_lora_rank)));
  return r;
}

TEST(CpuBackend, RankWithZeroPrefillTokens) {
  // L = 3 over P = 4: chunk 1, rank 3 owns chunks 3 and 4, both empty; it holds only the decode copy.
  CaseSpec spec;
  spec.pcp = 4;
  spec.requests = {{RequestKind::kPrefill, 3, 0}, {RequestKind::kDecode, 1, 9}};
  for (Transport t : kTransports) {
    SCOPED_TRACE(to_string(t));
    auto c = make_case(spec);
    ASSERT_EQ(c->plan.ranks[3].num_prefill_tokens, 0);
    run_and_check(spec, t);
  }
}

TEST(CpuBackend, RefusesPositionsPastTheModel) {
  // A prefill [0, 26) and a decode at 40: with max_position_embeddings 40 the decode's token is past the model.
  CaseSpec spec;
  spec.requests = {{RequestKind::kPrefill, 26, 0}, {RequestKind::kDecode, 1, 40}};
  auto c = make_case(spec);
  auto backend = make_cpu_backend(2);
  for (Transport t : kTransports) {
    SCOPED_TRACE(to_string(t));
    c->model.max_position_embeddings = 40;
    try {
      (void)backend->publish(c->setup, c->inputs, t);
      ADD_FAILURE() << "published a token at position 40 with max_position_embeddings 40";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("publish: plan: request 1 (decode at position 40) reaches position 40"), std::string::npos)
          << m;
      EXPECT_NE(m.find("max_position_embeddings is 40"), std::string::npos) << m;
    }
    c->model.max_position_embeddings = 41;  // the boundary: position 40 is the last one allowed
    EXPECT_NO_THROW((void)backend->publish(c->setup, c->inputs, t));
  }
}

TEST(CpuBackend, DecodeOnlyBatchWritesOnceFromRankZero) {
  CaseSpec spec;
  spec.pcp = 4;
  spec.requests = {{RequestKind::kDecode, 1, 5}, {RequestKind::kDecode, 1, 17}, {RequestKind::kDecode, 1, 64}};
  spec.alloc = padded_alloc();
  for (Transport t : kTransports) {
    SCOPED_TRACE(to_string(t));
    run_and_check(spec, t);
  }
}

TEST(CpuBackend, DeepseekPresetNeoxIndexerRope) {
  CaseSpec spec;
  spec.model = "deepseek-v3.2";
  spec.pcp = 2;
  spec.requests = mixed_requests(2);
  for (Transport t : kTransports) {
    SCOPED_TRACE(to_string(t));
    auto c = make_case(spec);
    const PublishResult r = run_and_check(spec, t);
    expect_bound_ok(bound(r, 1, *c, t == Transport::kCollect), "deepseek fp8 bound");
  }
}

TEST(CpuBackend, RepeatsOddLayerAndUbatchesGiveTheSameCaches) {
  CaseSpec spec;
  spec.pcp = 4;
  spec.requests = mixed_requests(4);
  auto c = make_case(spec);
  auto backend = make_cpu_backend(2);
  const PublishResult once = backend->publish(c->setup, c->inputs, Transport::kStaging);
  c->setup.repeats = 3;  // fence epochs advance across repeats
  c->setup.layer_idx = 5;  // the other double-buffer half
  c->setup.num_ubatches = 2;
  const PublishResult again = backend->publish(c->setup, c->inputs, Transport::kStaging);
  EXPECT_TRUE(test::same_caches(once, again, spec.fmt, "repeats/layer/ubatch"));
  const PublishResult direct = backend->publish(c->setup, c->inputs, Transport::kDirect);
  EXPECT_TRUE(test::same_caches(once, direct, spec.fmt, "direct with repeats"));
}

TEST(CpuBackend, ThreadCountDoesNotChangeBytes) {
  CaseSpec spec;
  spec.pcp = 2;
  spec.requests = {{RequestKind::kPrefill, 700, 0}, {RequestKind::kDecode, 1, 9}};
  auto c = make_case(spec);
  const PublishResult a = make_cpu_backend(1)->publish(c->setup, c->inputs, Transport::kCollect);
  const PublishResult b = make_cpu_backend(7)->publish(c->setup, c->inputs, Transport::kCollect);
  EXPECT_TRUE(test::same_caches(a, b, spec.fmt, "1 vs 7 threads"));
}

TEST(CpuBackend, ProfileCountsBytesOfThePerfModel) {
  // 8 ranks x 4096 even tokens would be docs/perf.md's table; here 8 ranks x 16 tokens, no padding, GLM-5 shapes.
  CaseSpec spec;
  spec.pcp = 8;
  spec.requests = {{RequestKind::kPrefill, 128, 0}};
  spec.topk_width = 2048;
  auto c = make_case(spec);
  ASSERT_EQ(c->plan.max_local_tokens, 16);
  auto backend = make_cpu_backend(2);
  const int64_t n = 128;
  auto stage = [](const PublishResult& r, const std::string& name) {
    for (const Stage& s : r.profile.stages)
      if (s.name == name) return s;
    ADD_FAILURE() << "no stage '" << name << "'";
    return Stage{};
  };
  // Per token (docs/perf.md): read 4096 + 1024 + 128 + 256 + 8 (+ 8 slot: direct), write 4096 + rows; the
  // top-k fill (8192 per token) is its own stage, as on the CUDA backend.
  const PublishResult direct = backend->publish(c->setup, c->inputs, Transport::kDirect);
  ASSERT_EQ(direct.profile.stages.size(), 3u);
  EXPECT_EQ(direct.profile.stages[0].name, "topk-fill");
  EXPECT_EQ(direct.profile.stages[0].bytes, n * 8192);
  EXPECT_EQ(direct.profile.stages[1].name, "dispatch");
  EXPECT_EQ(direct.profile.stages[1].bytes, n * (5520 + 4096 + 8 * (656 + 132)));
  const PublishResult staging = backend->publish(c->setup, c->inputs, Transport::kStaging);
  EXPECT_EQ(stage(staging, "dispatch").bytes, n * (5512 + 4096 + 8 * 800));
  EXPECT_EQ(staging.profile.stages[3].name, "combine");
  EXPECT_EQ(staging.profile.stages[3].bytes, 8 * n * (800 + 788));
  const PublishResult collect = backend->publish(c->setup, c->inputs, Transport::kCollect);
  EXPECT_EQ(collect.profile.stages[2].name, "all-gather");
  EXPECT_EQ(collect.profile.stages[2].bytes, 8 * n * 1408 * 2);
  EXPECT_EQ(stage(collect, "insert").bytes, 8 * n * (1408 + 788));
  EXPECT_EQ(collect.profile.total_bytes(), n * 8192 + n * (5512 + 4096 + 1408) + 8 * n * 1408 * 2 +
                                               8 * n * (1408 + 788));
  EXPECT_GE(collect.profile.total_ms(), 0.0);
}

// ---- bad input: pcpkv::Error naming the field, thrown before any write ---------------------------------

using test::error_of;

TEST(CpuBackend, BadInputThrowsNamingTheField) {
  CaseSpec spec;
  spec.pcp = 2;
  spec.requests = mixed_requests(2);
  auto backend = make_cpu_backend(2);
  struct Bad {
    const char* expect;
    std::function<void(test::PublishCase&)> mutate;
  };
  const std::vector<Bad> cases = {
      {"out of range", [](test::PublishCase& c) {
         c.plan.global_slots[3] = c.plan.num_slots();
       }},
      {"duplicates", [](test::PublishCase& c) { c.plan.global_slots[4] = c.plan.global_slots[2]; }},
      {"positions[1] = 99", [](test::PublishCase& c) { c.inputs.positions[1] = 99; }},
      {"kv has", [](test::PublishCase& c) { c.inputs.kv.resize(c.inputs.kv.size() - 512); }},
      {"index_k has", [](test::PublishCase& c) { c.inputs.index_k.pop_back(); }},
      {"kv_norm_w has", [](test::PublishCase& c) { c.inputs.weights.kv_norm_w.resize(100); }},
      {"fmt.k_scale = 0", [](test::PublishCase& c) { c.setup.fmt.k_scale = 0.0f; }},
      {"fmt.k_scale = -0.5", [](test::PublishCase& c) { c.setup.fmt.k_scale = -0.5f; }},
      {"base_offset = -16", [](test::PublishCase& c) { c.setup.alloc.base_offset = -16; }},
      {"mla_row_pad", [](test::PublishCase& c) { c.setup.alloc.mla_row_pad = -4; }},
      {"row_stride = 664", [](test::PublishCase& c) { c.setup.alloc.mla_row_pad = 8; }},
      {"indexer cache: block_stride", [](test::PublishCase& c) { c.setup.alloc.index_block_pad = 4; }},
      {"repeats = 0", [](test::PublishCase& c) { c.setup.repeats = 0; }},
      {"setup.plan is null", [](test::PublishCase& c) { c.setup.plan = nullptr; }},
  };
  for (const Bad& b : cases) {
    auto c = make_case(spec);
    b.mutate(*c);
    for (Transport t : kTransports) {
      const std::string msg = error_of([&] { backend->publish(c->setup, c->inputs, t); });
      EXPECT_NE(msg.find(b.expect), std::string::npos) << "expected '" << b.expect << "' in: " << msg;
    }
  }
}

TEST(CpuBackend, TransportNamesAndProfileTotals) {
  for (Transport t : kTransports) EXPECT_EQ(parse_transport(to_string(t)), t);
  EXPECT_NE(error_of([] { parse_transport("nvls"); }).find("unknown transport 'nvls'"), std::string::npos);
  StageProfile p;
  p.stages = {{"dispatch", 1.5, 100}, {"fence", 0.25, 8}};
  EXPECT_DOUBLE_EQ(p.total_ms(), 1.75);
  EXPECT_EQ(p.total_bytes(), 108);
  EXPECT_EQ(make_cpu_backend(3)->device(), "CPU (3 threads)");
  EXPECT_EQ(make_cpu_backend()->name(), "cpu");
}

// A huge --transport or --backend value was quoted whole (a 100 KB value gave a 100 KB message): clipped
// (input_limits.h clip), the flag and the known names still named.
TEST(CpuBackend, UnknownTransportAndBackendNamesAreQuotedClipped) {
  const std::string huge(100000, 'x');
  test::expect_clipped_error(error_of([&] { parse_transport(huge); }), "--transport: unknown transport 'xxx",
                             "known: collect, staging, direct");
  test::expect_clipped_error(error_of([&] { make_backend(huge); }), "--backend: unknown backend 'xxx",
                             "known: auto, cpu, cuda");
}

}  // namespace
}  // namespace pcpkv
