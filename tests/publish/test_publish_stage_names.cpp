// pcpkv-test-labels: cuda
// The CUDA backend and its Publisher report exactly the transport tables' stages
// (src/publish/drivers/transport_table.h): the same names and bytes as the CPU backend for every transport, on indexer
// layers (with and without a top-k buffer) and shared layers; a fused top-k fill drops the topk-fill stage and moves
// its bytes into the dispatch. Skips with the reason when no GPU is visible.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/cuda.h"
#include "publish/drivers/cuda/publisher.h"
#include "publish/drivers/publish_layout.h"
#include "publish/drivers/transport_table.h"
#include "support/gpu.h"
#include "support/publish_case.h"
#include "support/stage_cases.h"

namespace pcpkv {
namespace {

using test::CaseSpec;
using test::make_case;

constexpr Transport kTransports[] = {Transport::kCollect, Transport::kStaging, Transport::kDirect};

using test::LayerCase;

class CudaBackendStages : public ::testing::TestWithParam<LayerCase> {};

TEST_P(CudaBackendStages, SameNamesAndBytesAsTheTableAndTheCpuBackend) {
  REQUIRE_GPU();
  const LayerCase lc = GetParam();
  auto c = make_case(test::stage_case_spec(lc));
  const PublishLayout l = make_publish_layout(c->setup);
  auto cpu = make_cpu_backend(2);
  auto gpu = cuda::make_backend(0);
  for (Transport t : kTransports) {
    const PublishResult want = cpu->publish(c->setup, c->inputs, t);
    const PublishResult got = gpu->publish(c->setup, c->inputs, t);
    const std::vector<std::string> names = stage_names(t, l, false);
    ASSERT_EQ(got.profile.stages.size(), names.size()) << lc.what << " " << to_string(t);
    ASSERT_EQ(want.profile.stages.size(), names.size()) << lc.what << " " << to_string(t);
    for (size_t k = 0; k < names.size(); ++k) {
      EXPECT_EQ(got.profile.stages[k].name, names[k]) << lc.what << " " << to_string(t) << " stage " << k;
      EXPECT_EQ(got.profile.stages[k].name, want.profile.stages[k].name) << lc.what << " " << to_string(t);
      EXPECT_EQ(got.profile.stages[k].bytes, want.profile.stages[k].bytes) << lc.what << " " << to_string(t) << " "
                                                                           << names[k];
      EXPECT_GE(got.profile.stages[k].ms, 0.0) << lc.what << " " << to_string(t) << " " << names[k];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, CudaBackendStages, test::layer_cases(), test::layer_case_name);

// The stages a timer sees on the stream are the ones stage_model() names, for separate and fused fills.
TEST(CudaPublisherStages, TimerMarksTheTablesStepsSeparateAndFused) {
  REQUIRE_GPU();
  CaseSpec spec;
  spec.pcp = 2;
  spec.topk_width = 16;
  auto c = make_case(spec);
  const PublishLayout l = make_publish_layout(c->setup);
  for (bool fused : {false, true}) {
    cuda::PublisherOptions opt;
    opt.variant.fuse_topk = fused;
    opt.variant.pdl = false;
    cuda::Publisher pub(c->setup, c->inputs, opt);
    cuda::Stream stream;
    for (Transport t : kTransports) {
      cuda::StageTimer timer;
      pub.enqueue(t, stream.get(), &timer);
      stream.sync();
      pub.check_fence();
      const auto timed = timer.read();
      const std::vector<Stage> model = pub.stage_model(t);
      const std::vector<std::string> names = stage_names(t, l, fused);
      ASSERT_EQ(timed.size(), names.size()) << to_string(t) << (fused ? " fused" : " separate");
      ASSERT_EQ(model.size(), names.size()) << to_string(t) << (fused ? " fused" : " separate");
      for (size_t k = 0; k < names.size(); ++k) {
        EXPECT_EQ(timed[k].first, names[k]) << to_string(t) << (fused ? " fused" : " separate");
        EXPECT_EQ(model[k].name, names[k]) << to_string(t) << (fused ? " fused" : " separate");
      }
      EXPECT_EQ(names.front(), fused ? "dispatch" : "topk-fill") << to_string(t);
    }
  }
}

}  // namespace
}  // namespace pcpkv
