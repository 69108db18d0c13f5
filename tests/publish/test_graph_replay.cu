// pcpkv-test-labels: cuda
// CUDA-graph capture of one layer's publication and >= 100 replays on re-poisoned caches: every replay
// reproduces the CPU reference's bytes, and the device-resident fence epochs advance by one per replay
// (SPEC section 5: the epoch lives on the device, so a replayed graph never reuses an epoch).
// Skips with the reason when no GPU is visible.
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/cuda/buffers.h"
#include "core/cuda/check.h"
#include "publish/cuda/publisher.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/publish/cuda.h"
#include "support/publish_case.h"
#include "support/gpu.h"

namespace pcpkv {
namespace {

constexpr int kReplays = 100;

class GraphReplay : public ::testing::TestWithParam<Transport> {};

TEST_P(GraphReplay, ReplaysReproduceCpuBytesAndAdvanceEpochs) {
  REQUIRE_GPU();
  const Transport t = GetParam();
  test::CaseSpec spec;
  spec.pcp = 4;
  spec.requests = {{RequestKind::kPrefill, 13 * 8 + 3, 0}, {RequestKind::kDecode, 1, 40}, {RequestKind::kPrefill, 9, 16}};
  spec.alloc.guard_bytes = 64;
  spec.alloc.base_offset = 4096 + 64;
  spec.alloc.mla_row_pad = 32;
  spec.alloc.index_block_pad = 16;
  spec.topk_width = 64;
  auto c = test::make_case(spec);
  const PublishResult want = make_cpu_backend(2)->publish(c->setup, c->inputs, t);

  cuda_detail::Publisher pub(c->setup, c->inputs);
  cuda_detail::Stream stream;
  pub.enqueue(t, stream.get());  // warm-up outside the capture (module load, occupancy queries)
  stream.sync();
  pub.check_fence();
  const std::vector<uint64_t> base = pub.fence().epochs();

  cudaGraph_t graph = nullptr;
  PCPKV_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  pub.enqueue(t, stream.get());
  PCPKV_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  PCPKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  const bool fenced = t != Transport::kCollect;
  for (int i = 0; i < kReplays; ++i) {
    pub.poison();  // every replay must write every byte again
    PCPKV_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.sync();
    pub.check_fence();
    const std::vector<uint64_t> e = pub.fence().epochs();
    for (size_t r = 0; r < e.size(); ++r)
      ASSERT_EQ(e[r], base[r] + (fenced && r % static_cast<size_t>(c->setup.num_ubatches) == 0 ? i + 1 : 0))
          << "epoch of rank/barrier " << r << " after replay " << i;
    const PublishResult got = pub.download(t);
    ASSERT_TRUE(test::same_outputs(want, got, spec.fmt, fmt::format("replay {}", i)));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

INSTANTIATE_TEST_SUITE_P(Transports, GraphReplay,
                         ::testing::Values(Transport::kCollect, Transport::kStaging, Transport::kDirect),
                         [](const ::testing::TestParamInfo<Transport>& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace pcpkv
