// pcpkv-test-labels: cuda
// Every publication variant of the CUDA publisher (cuda_detail::PublishVariant: dispatch kernel simple /
// prefetch / warp, top-k fill fused or separate, combine 1 / 2 / 4 rows per warp, PDL off / on) against the
// CPU reference backend, byte for byte: every replica's whole allocations (guards, padding, unwritten slots),
// q_c_out and the top-k buffer, for every transport; then CUDA graphs of several back-to-back publications
// with PDL on, replayed on re-poisoned caches (a dependent kernel that read before its grid-dependency wait
// would see the poison). The *_huge_rows cases hold rows whose norms overflow fp32 (the overflow guard of
// pcpkv/device/token_math.h). Skips with the reason when no GPU is visible.
#include <cuda_runtime_api.h>

#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/cuda/buffers.h"
#include "core/cuda/check.h"
#include "publish/cuda/publisher.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/cuda.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/pdl.h"
#include "support/error_of.h"
#include "support/huge_rows.h"
#include "support/publish_case.h"
#include "support/gpu.h"

namespace pcpkv {
namespace {

using cuda_detail::Publisher;
using cuda_detail::PublisherOptions;
using cuda_detail::PublishVariant;

constexpr Transport kTransports[] = {Transport::kCollect, Transport::kStaging, Transport::kDirect};

const char* const kVariants[] = {"prefetch:separate:1", "simple:fused:2",       "warp:fused:4",
                                 "warp:separate:1",     "warp_pf:fused:4",      "warp:fused:2:pdl",
                                 "prefetch:fused:4:pdl", "warp_pf:separate:4:pdl", "simple:separate:1:pdl"};

struct VariantCase {
  std::string name;
  test::CaseSpec spec;
  bool huge_rows = false;  // test::make_rows_huge: norms that overflow fp32 (the overflow guard, token_math.h)
  int64_t huge_first = 0, huge_every = 2;  // which rows make_rows_huge changes
};

std::vector<VariantCase> variant_cases() {
  std::vector<VariantCase> v;
  {  // uneven ranks, decodes, padded allocation inside a shared buffer, top-k fill
    VariantCase c;
    c.name = "glm5_pcp4_mixed_padded";
    c.spec.pcp = 4;
    c.spec.requests = {{RequestKind::kPrefill, 13 * 8 + 5, 0}, {RequestKind::kDecode, 1, 40},
                       {RequestKind::kPrefill, 7, 20}, {RequestKind::kDecode, 1, 3}};
    c.spec.alloc.guard_bytes = 64;
    c.spec.alloc.base_offset = 4096 + 48;
    c.spec.alloc.mla_row_pad = 16;
    c.spec.alloc.mla_block_pad = 48;
    c.spec.alloc.index_block_pad = 32;
    c.spec.topk_width = 64;
    v.push_back(c);
  }
  {  // DeepSeek-V3.2 dims (q_lora 1536: 6 of the warp kernel's 8 leaves per lane), static fp8, PCP 8,
     // enough tokens that every persistent warp loops
    VariantCase c;
    c.name = "deepseek_pcp8_fp8_many_tokens";
    c.spec.model = "deepseek-v3.2";
    c.spec.pcp = 8;
    c.spec.block_size = 64;
    c.spec.requests = {{RequestKind::kPrefill, 12000, 0}, {RequestKind::kDecode, 1, 77}};
    c.spec.fmt.kv_format = KvFormat::kFp8;
    c.spec.fmt.k_scale = 0.0213f;
    c.spec.topk_width = 256;
    v.push_back(c);
  }
  {  // a shared layer (no indexer, no top-k) in bf16
    VariantCase c;
    c.name = "glm5_pcp2_bf16_shared";
    c.spec.pcp = 2;
    c.spec.requests = {{RequestKind::kPrefill, 301, 0}, {RequestKind::kDecode, 1, 9}};
    c.spec.fmt.kv_format = KvFormat::kBf16;
    c.spec.fmt.has_indexer = false;
    v.push_back(c);
  }
  // The top-k fill modes (pcpkv/publish/dispatch.h TopkFill) in every variant, fused and separate: tail fills only
  // each rank's padding rows (uneven ranks have some), none nothing; the CPU backend is the oracle.
  for (TopkFill f : {TopkFill::kTail, TopkFill::kNone}) {
    VariantCase c = v[0];
    c.name += std::string("_topk_") + to_string(f);
    c.spec.topk_fill = f;
    v.push_back(c);
  }
  // Rows whose norms overflow fp32: the guard's rescaled path must give the CPU's bytes in every
  // kernel (CTA and warp, Q / KV / indexer reductions), mixed with ordinary rows.
  for (VariantCase c : {v[0], v[2]}) {
    c.name += "_huge_rows";
    c.huge_rows = true;
    v.push_back(c);
  }
  {
    VariantCase c;
    c.name = "deepseek_pcp2_fp8_huge_rows";
    c.spec.model = "deepseek-v3.2";
    c.spec.requests = {{RequestKind::kPrefill, 301, 0}, {RequestKind::kDecode, 1, 5}};
    c.spec.fmt.kv_format = KvFormat::kFp8;
    c.spec.fmt.k_scale = 0.0213f;
    c.huge_rows = true;
    v.push_back(c);
  }
  {  // A few huge rows among 12000 tokens: the CTA kernel's cold pass (dispatch.cu) runs in a few CTAs only and
     // rewrites their ordinary tokens too; every other CTA must not take it.
    VariantCase c = v[1];
    c.name += "_sparse_huge_rows";
    c.huge_rows = true;
    c.huge_first = 1234;
    c.huge_every = 2999;
    v.push_back(c);
  }
  return v;
}

class PublishVariants : public ::testing::TestWithParam<VariantCase> {};

TEST_P(PublishVariants, EveryVariantEveryTransportEqualsCpu) {
  REQUIRE_GPU();
  const VariantCase& vc = GetParam();
  auto c = test::make_case(vc.spec);
  if (vc.huge_rows) test::make_rows_huge(c->inputs, vc.huge_first, vc.huge_every);
  auto cpu = make_cpu_backend(2);
  std::vector<PublishResult> want;
  for (Transport t : kTransports) want.push_back(cpu->publish(c->setup, c->inputs, t));
  Publisher pub(c->setup, c->inputs);
  cuda_detail::Stream stream;
  for (const char* name : kVariants) {
    pub.set_variant(PublishVariant::parse(name));
    EXPECT_EQ(pub.variant().name(), name);
    for (size_t ti = 0; ti < std::size(kTransports); ++ti) {
      const Transport t = kTransports[ti];
      const std::string what = fmt::format("{} {} [{}]", vc.name, to_string(t), name);
      SCOPED_TRACE(what);
      pub.poison();
      pub.enqueue(t, stream.get());
      stream.sync();
      pub.check_fence();
      const PublishResult got = pub.download(t);
      EXPECT_TRUE(test::same_outputs(want[ti], got, vc.spec.fmt, what));
      EXPECT_TRUE(test::replicas_identical(got, vc.spec.fmt));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, PublishVariants, ::testing::ValuesIn(variant_cases()),
                         [](const ::testing::TestParamInfo<VariantCase>& info) { return info.param.name; });

// PDL on and off inside CUDA graphs: kLayers publications back to back per graph (so PDL overlaps each
// dispatch with the previous layer's fence / combine), replays on re-poisoned caches equal the CPU bytes,
// and the fence epochs advance by kLayers per replay.
class PdlGraph : public ::testing::TestWithParam<Transport> {};

TEST_P(PdlGraph, PdlOnAndOffReplaysEqualCpu) {
  REQUIRE_GPU();
  constexpr int kLayers = 3, kReplays = 20;
  const Transport t = GetParam();
  test::CaseSpec spec;
  spec.pcp = 8;
  spec.requests = {{RequestKind::kPrefill, 8 * 64 + 3, 0}, {RequestKind::kDecode, 1, 40}};
  spec.alloc.guard_bytes = 64;
  spec.alloc.base_offset = 4096 + 64;
  spec.alloc.mla_row_pad = 32;
  spec.topk_width = 128;
  auto c = test::make_case(spec);
  const PublishResult want = make_cpu_backend(2)->publish(c->setup, c->inputs, t);
  for (const char* name : {"warp:fused:4", "warp:fused:4:pdl", "warp_pf:fused:2:pdl", "prefetch:separate:1:pdl"}) {
    SCOPED_TRACE(name);
    PublisherOptions opts;
    opts.variant = PublishVariant::parse(name);
    Publisher pub(c->setup, c->inputs, opts);
    cuda_detail::Stream stream;
    pub.enqueue(t, stream.get());  // warm-up outside the capture
    stream.sync();
    pub.check_fence();
    const std::vector<uint64_t> base = pub.fence().epochs();
    cudaGraph_t graph = nullptr;
    PCPKV_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < kLayers; ++l) pub.enqueue(t, stream.get());
    PCPKV_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
    cudaGraphExec_t exec = nullptr;
    PCPKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < kReplays; ++i) {
      pub.poison();
      PCPKV_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
      stream.sync();
      pub.check_fence();
      const std::vector<uint64_t> e = pub.fence().epochs();
      for (size_t r = 0; r < e.size(); ++r)
        ASSERT_EQ(e[r], base[r] + (r % static_cast<size_t>(c->setup.num_ubatches) == 0 ? kLayers * (i + 1) : 0))
            << "epoch of rank/barrier " << r << " after replay " << i;
      ASSERT_TRUE(test::same_outputs(want, pub.download(t), spec.fmt, fmt::format("{} replay {}", name, i)));
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, PdlGraph, ::testing::Values(Transport::kStaging, Transport::kDirect),
                         [](const ::testing::TestParamInfo<Transport>& info) { return std::string(to_string(info.param)); });

TEST(PublishVariant, NamesParseAndBadNamesThrow) {
  for (const char* name : kVariants) EXPECT_EQ(PublishVariant::parse(name).name(), name);
  EXPECT_EQ(PublishVariant::parse("warp").name(), fmt::format("warp:separate:{}", cuda_detail::kDefaultCombineRowsPerWarp));
  EXPECT_THROW(PublishVariant::parse("fast"), Error);
  EXPECT_THROW(PublishVariant::parse("warp:fuse"), Error);
  EXPECT_THROW(PublishVariant::parse("warp:fused:3"), Error);
  EXPECT_THROW(PublishVariant::parse("warp:fused:4:pdx"), Error);
  EXPECT_THROW(PublishVariant::parse("warp:fused:4:pdl:x"), Error);
  EXPECT_EQ(cuda_detail::collect_baseline_variant().name(), "prefetch:separate:1");
}

// A huge variant name (or one huge part of it) was quoted whole, twice: every quoted part is clipped
// (input_limits.h clip), the message still names the part that is wrong.
TEST(PublishVariant, HugeNamesAreQuotedClipped) {
  const std::string huge(100000, 'v');
  const struct {
    std::string name, head, tail;
  } cases[] = {
      {"warp:fused:4:pdl:" + huge, "variant 'warp:fused:4:pdl:vvv", "expected <dispatch>"},
      {"warp:" + huge, "variant 'warp:vvv", "top-k fill 'vvv"},
      {"warp:fused:" + huge, "variant 'warp:fused:vvv", "combine rows per warp 'vvv"},
      {"warp:fused:4:" + huge, "variant 'warp:fused:4:vvv", "the 4th part 'vvv"},
      {huge, "dispatch variant 'vvv", "is not auto, simple, prefetch, warp, warp_pf, warp_token or warp_split"},
  };
  for (const auto& c : cases)
    test::expect_clipped_error(test::error_of([&] { PublishVariant::parse(c.name); }), c.head, c.tail);
}

}  // namespace
}  // namespace pcpkv
