// pcpkv-test-labels: cuda
// The top-k fill modes (pcpkv/publish/dispatch.h TopkFill) in every CUDA dispatch kernel (CTA simple / prefetch, warp,
// warp_pf) followed by the CUDA indexer top-k: byte-identical to the CPU oracle's full fill + indexer, on a
// poisoned buffer (the case: tests/support/topk_fill_case.h). The publisher's fused and separate fills are in
// test_publish_variants (the *_topk_tail / *_topk_none cases). Skips without a GPU.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/cuda/buffers.h"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/cpu.h"
#include "support/gpu.h"
#include "support/topk_fill_case.h"

namespace pcpkv {
namespace {

using cuda_detail::DeviceBuffer;
using cuda_detail::DispatchVariant;
using test::TopkFillCase;
constexpr int64_t kN = TopkFillCase::kIndexerRows, kT = TopkFillCase::kRows, kK = TopkFillCase::kTopk;

struct DeviceCase {
  DeviceBuffer kv, k_pe, index_k, positions, kv_w, ln_w, ln_b, rope, index_k_out;
  DeviceBuffer q_fp8, q_scale, weights, idx_pos, req, tables, cache;
  explicit DeviceCase(const TopkFillCase& c)
      : kv(DeviceBuffer::from(c.kv)),
        k_pe(DeviceBuffer::from(c.k_pe)),
        index_k(DeviceBuffer::from(c.index_k)),
        positions(DeviceBuffer::from(c.positions)),
        kv_w(DeviceBuffer::from(c.kv_w)),
        ln_w(DeviceBuffer::from(c.ln_w)),
        ln_b(DeviceBuffer::from(c.ln_b)),
        rope(DeviceBuffer::from(c.rope.cos_sin)),
        index_k_out(kT * 128 * 2),
        q_fp8(DeviceBuffer::from(c.idx.q_fp8)),
        q_scale(DeviceBuffer::from(c.idx.q_scale)),
        weights(DeviceBuffer::from(c.idx.weights)),
        idx_pos(DeviceBuffer::from(c.idx.token_position)),
        req(DeviceBuffer::from(c.idx.token_request)),
        tables(DeviceBuffer::from(c.idx.tables)),
        cache(DeviceBuffer::from(c.idx.cache)) {}
};

/// CUDA dispatch (variant v, fill mode) into a poisoned device buffer; with_indexer: then cuda::indexer over the
/// first kN rows. Returns the buffer.
std::vector<int32_t> run_gpu(TopkFillCase& c, DeviceCase& d, DispatchVariant v, TopkFill mode, bool with_indexer) {
  DeviceBuffer topk = DeviceBuffer::from(TopkFillCase::poisoned());
  cuda_detail::DispatchJob job;
  job.params = c.dispatch(mode, kN, topk.as<int32_t>(), d.kv.as<const uint16_t>(), d.k_pe.as<const uint16_t>(),
                          d.index_k.as<const uint16_t>(), d.positions.as<const int64_t>(), d.kv_w.as<const float>(),
                          d.ln_w.as<const float>(), d.ln_b.as<const float>(), d.rope.as<const float>(),
                          d.index_k_out.as<uint16_t>());
  cuda_detail::launch_dispatch(&job, 1, nullptr, v);
  if (with_indexer) {
    IndexerParams p = c.indexer(topk.as<int32_t>());
    p.q_fp8 = d.q_fp8.as<const uint8_t>();
    p.q_scale = d.q_scale.as<const float>();
    p.weights = d.weights.as<const float>();
    p.positions = d.idx_pos.as<const int64_t>();
    p.request_idx = d.req.as<const int32_t>();
    p.block_tables = d.tables.as<const int32_t>();
    p.index_cache = d.cache.as<const uint8_t>();
    DeviceBuffer ws(cuda::indexer_min_workspace_bytes(p) * kN);
    cuda::indexer(p, ws.data(), ws.bytes(), nullptr);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return topk.download<int32_t>(kT * kK);
}

std::vector<int32_t> run_cpu(TopkFillCase& c, TopkFill mode, bool with_indexer) {
  std::vector<int32_t> topk = TopkFillCase::poisoned();
  std::vector<uint16_t> out(kT * 128);
  dispatch_reference(c.dispatch(mode, kN, topk.data(), c.kv.data(), c.k_pe.data(), c.index_k.data(), c.positions.data(),
                          c.kv_w.data(), c.ln_w.data(), c.ln_b.data(), c.rope.cos_sin.data(), out.data()),
               2);
  if (with_indexer) indexer_reference(c.indexer(topk.data()));
  return topk;
}

TEST(TopkFillCuda, EveryKernelEveryModeThenIndexerEqualsFullFillOnCpu) {
  REQUIRE_GPU();
  TopkFillCase c;
  DeviceCase d(c);
  const std::vector<int32_t> want = run_cpu(c, TopkFill::kFull, true);
  for (DispatchVariant v : {DispatchVariant::kSimple, DispatchVariant::kPrefetch, DispatchVariant::kWarp,
                            DispatchVariant::kWarpPrefetch, DispatchVariant::kWarpToken, DispatchVariant::kWarpSplit})
    for (TopkFill mode : {TopkFill::kFull, TopkFill::kTail, TopkFill::kNone}) {
      const std::string what = fmt::format("{} {}", cuda_detail::to_string(v), to_string(mode));
      // The fill alone: exactly the CPU oracle's rows (poison elsewhere).
      const std::vector<int32_t> fill = run_gpu(c, d, v, mode, false);
      EXPECT_EQ(0, std::memcmp(fill.data(), run_cpu(c, mode, false).data(), fill.size() * 4)) << what << ": fill";
      if (mode == TopkFill::kNone) continue;  // none leaves the padding rows to nobody (not exact here)
      const std::vector<int32_t> got = run_gpu(c, d, v, mode, true);
      for (int64_t i = 0; i < kT * kK; ++i)
        ASSERT_EQ(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)])
            << what << ": row " << i / kK << " entry " << i % kK << " after the indexer";
    }
}

}  // namespace
}  // namespace pcpkv
