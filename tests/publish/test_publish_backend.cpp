// pcpkv-test-labels: cuda
// The CUDA backend (cuda::make_backend) against the CPU reference backend (make_cpu_backend), byte for byte:
// every replica's whole allocations (guards, base offset, row / block padding, unwritten slots), q_c_out and
// the top-k fill, for every transport, kv format and scale rule, indexer and shared layers, PCP 1/2/3/4/8,
// uneven ranks (13 tokens each), a rank with no prefill tokens, and mixed decode + prefill batches.
// Skips with the reason when no GPU is visible.
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/cuda.h"
#include "pcpkv/core/error.h"
#include "pcpkv/publish/checks.h"
#include "support/publish_case.h"
#include "support/gpu.h"

namespace pcpkv {
namespace {

constexpr Transport kTransports[] = {Transport::kCollect, Transport::kStaging, Transport::kDirect};

AllocationOptions padded_alloc() {
  AllocationOptions a;
  a.guard_bytes = 64;
  a.base_offset = 4096 + 48;  // inside a shared allocation, 16-byte but not 64-byte aligned
  a.mla_row_pad = 16;
  a.mla_block_pad = 48;
  a.index_block_pad = 32;
  return a;
}

/// Everything of `gpu` equals `cpu`: geometry, every allocation, q_c_out, top-k.
void expect_same_result(const PublishResult& cpu, const PublishResult& gpu, const CacheFormat& fmt,
                        const std::string& what) {
  ASSERT_EQ(gpu.mla_alloc.size(), cpu.mla_alloc.size()) << what;
  EXPECT_EQ(gpu.mla_cache_offset, cpu.mla_cache_offset) << what;
  EXPECT_EQ(gpu.mla_geometry.block_stride, cpu.mla_geometry.block_stride) << what;
  EXPECT_EQ(gpu.index_geometry.block_stride, cpu.index_geometry.block_stride) << what;
  EXPECT_TRUE(test::same_outputs(cpu, gpu, fmt, what));
}

struct BackendCase {
  std::string name;
  int32_t pcp = 2;
  std::vector<RequestSpec> requests;
  CacheFormat fmt;
  bool padded = true;
  int64_t topk_width = 16;
  std::string model = "glm-5";
  int32_t block_size = 16;
  int32_t layer_idx = 0;
  bool own_index_blocks = false;  // the indexer cache at its own slots (docs/spec.md 4.2)
};
std::string backend_name(const ::testing::TestParamInfo<BackendCase>& info) { return info.param.name; }

class CudaVsCpuBackend : public ::testing::TestWithParam<BackendCase> {};

TEST_P(CudaVsCpuBackend, EveryTransportByteIdentical) {
  REQUIRE_GPU();
  const BackendCase& bc = GetParam();
  test::CaseSpec spec;
  spec.model = bc.model;
  spec.pcp = bc.pcp;
  spec.requests = bc.requests;
  spec.fmt = bc.fmt;
  spec.block_size = bc.block_size;
  if (bc.padded) spec.alloc = padded_alloc();
  spec.topk_width = bc.topk_width;
  spec.own_index_blocks = bc.own_index_blocks;
  spec.index_extra_blocks = bc.own_index_blocks ? 2 : 0;
  auto c = test::make_case(spec);
  c->setup.layer_idx = bc.layer_idx;
  auto cpu = make_cpu_backend(2);
  auto gpu = cuda::make_backend();
  EXPECT_EQ(gpu->name(), "cuda");
  std::vector<PublishResult> results;
  for (Transport t : kTransports) {
    const std::string what = fmt::format("{} {}", bc.name, to_string(t));
    SCOPED_TRACE(what);
    const PublishResult want = cpu->publish(c->setup, c->inputs, t);
    PublishResult got = gpu->publish(c->setup, c->inputs, t);
    expect_same_result(want, got, spec.fmt, what);
    EXPECT_TRUE(test::replicas_identical(got, spec.fmt));
    EXPECT_TRUE(test::all_untouched(got, c->plan, spec.fmt));
    for (const Stage& s : got.profile.stages) {
      EXPECT_GE(s.ms, 0.0) << s.name;
      EXPECT_GT(s.bytes, 0) << s.name;
    }
    results.push_back(std::move(got));
  }
  EXPECT_TRUE(test::same_caches(results[2], results[1], spec.fmt, "staging vs direct"));
}

CacheFormat make_fmt(KvFormat f, DsMlaScale s, bool indexer, float k_scale = 1.0f) {
  CacheFormat fmt;
  fmt.kv_format = f;
  fmt.ds_mla_scale = s;
  fmt.has_indexer = indexer;
  fmt.k_scale = k_scale;
  return fmt;
}

// Uneven lengths (13 tokens per rank plus a remainder), decodes, a second prefill with context.
std::vector<RequestSpec> mixed_requests(int32_t pcp) {
  return {{RequestKind::kPrefill, 13 * 2 * pcp + 5, 0},
          {RequestKind::kDecode, 1, 40},
          {RequestKind::kPrefill, 7, 20},
          {RequestKind::kDecode, 1, 3}};
}

std::vector<BackendCase> backend_cases() {
  std::vector<BackendCase> v;
  for (int32_t P : {1, 2, 3, 4, 8}) {
    BackendCase c;
    c.name = fmt::format("pcp{}_mixed", P);
    c.pcp = P;
    c.requests = mixed_requests(P);
    v.push_back(c);
  }
  {  // 13 tokens on every rank exactly: one prefill of 13 * P
    BackendCase c;
    c.name = "pcp4_13_each";
    c.pcp = 4;
    c.requests = {{RequestKind::kPrefill, 13 * 4, 0}};
    v.push_back(c);
  }
  {  // a prefill shorter than 2P chunks: some ranks get no prefill tokens, only decodes
    BackendCase c;
    c.name = "pcp8_rank_without_prefill";
    c.pcp = 8;
    c.requests = {{RequestKind::kPrefill, 5, 0}, {RequestKind::kDecode, 1, 9}, {RequestKind::kDecode, 1, 17}};
    v.push_back(c);
  }
  {  // decode only
    BackendCase c;
    c.name = "pcp4_decode_only";
    c.pcp = 4;
    c.requests = {{RequestKind::kDecode, 1, 5}, {RequestKind::kDecode, 1, 100}, {RequestKind::kDecode, 1, 31}};
    v.push_back(c);
  }
  const struct {
    const char* name;
    KvFormat f;
    DsMlaScale s;
    float k;
  } formats[] = {{"ds_mla_pow2", KvFormat::kFp8DsMla, DsMlaScale::kPow2, 1.0f},
                 {"ds_mla_raw", KvFormat::kFp8DsMla, DsMlaScale::kRaw, 1.0f},
                 {"fp8", KvFormat::kFp8, DsMlaScale::kPow2, 0.0213f},
                 {"bf16", KvFormat::kBf16, DsMlaScale::kPow2, 1.0f}};
  for (const auto& f : formats)
    for (bool indexer : {true, false}) {
      BackendCase c;
      c.name = fmt::format("pcp4_{}_{}", f.name, indexer ? "indexer" : "shared");
      c.pcp = 4;
      c.requests = mixed_requests(4);
      c.fmt = make_fmt(f.f, f.s, indexer, f.k);
      v.push_back(c);
    }
  {  // DeepSeek-V3.2 dims (q_lora 1536, NeoX indexer rope, YaRN), dense layout, odd layer (staging half 1)
    BackendCase c;
    c.name = "deepseek_dense_layer1";
    c.model = "deepseek-v3.2";
    c.pcp = 2;
    c.requests = mixed_requests(2);
    c.padded = false;
    c.layer_idx = 1;
    c.block_size = 64;
    c.topk_width = 2048;
    v.push_back(c);
  }
  for (int32_t P : {2, 4}) {  // the indexer cache's own block table: distinct indexer slots, padded blocks
    BackendCase c;
    c.name = fmt::format("pcp{}_own_index_blocks", P);
    c.pcp = P;
    c.requests = mixed_requests(P);
    c.own_index_blocks = true;
    v.push_back(c);
  }
  {  // no top-k fill
    BackendCase c;
    c.name = "pcp2_no_topk";
    c.pcp = 2;
    c.requests = mixed_requests(2);
    c.topk_width = 0;
    v.push_back(c);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaVsCpuBackend, ::testing::ValuesIn(backend_cases()), backend_name);

TEST(CudaBackend, BadInputThrowsNamingTheField) {
  REQUIRE_GPU();
  test::CaseSpec spec;
  auto c = test::make_case(spec);
  auto gpu = cuda::make_backend();
  c->inputs.kv.pop_back();
  EXPECT_THROW(gpu->publish(c->setup, c->inputs, Transport::kDirect), Error);
  auto c2 = test::make_case(spec);
  c2->setup.alloc.base_offset = 8;  // guard + offset not a multiple of 16
  EXPECT_THROW(gpu->publish(c2->setup, c2->inputs, Transport::kStaging), Error);
  EXPECT_THROW(cuda::make_backend(1 << 20), Error);
}

}  // namespace
}  // namespace pcpkv
