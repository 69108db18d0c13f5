// Link bandwidth between the GPUs of this host (cuda::bench_link in pcpkv/publish/cuda_multiproc.h), measured with
// copy-engine peer copies (cudaMemcpyPeerAsync) in ONE process that holds every GPU: one pair one way, the
// same pair both ways at once, and every ordered pair at once (what each GPU receives while all GPUs send to
// all others, the situation of a PCP publication). The publication's P2P stores are judged against these.
#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "core/cuda/buffers.h"
#include "core/cuda/check.h"
#include "pcpkv/publish/cuda.h"
#include "pcpkv/publish/cuda_multiproc.h"
#include "pcpkv/core/error.h"
#include "pcpkv/publish/multiproc.h"
#include "pcpkv_bench/fence.h"
#include "pcpkv_bench/link.h"

namespace pcpkv::cuda {

namespace {

using cuda::DeviceBuffer;
using cuda::Event;
using cuda::Stream;

// Events and streams belong to the device current at creation: every object below is made after a
// cudaSetDevice of its device.
struct Gpu {
  int32_t device = 0;
  DeviceBuffer src;
  std::vector<DeviceBuffer> dst;  // [n] dst[j]: what GPU j sends here (dst[self] unused)
  std::vector<std::unique_ptr<Stream>> out;  // [n] out[j]: this GPU's copies to GPU j
};

}  // namespace

LinkBenchResult bench_link(const LinkBenchOptions& o) {
  std::string why;
  const int visible = device_count(&why);
  PCPKV_CHECK(visible >= 2, "bench-link needs >= 2 visible GPUs, found {}{}", visible, why.empty() ? "" : ": " + why);
  std::vector<int32_t> ids = o.gpus;
  if (ids.empty())
    for (int32_t d = 0; d < visible; ++d) ids.push_back(d);
  PCPKV_CHECK(ids.size() >= 2, "--gpus: bench-link needs >= 2 GPUs, got {}", ids.size());
  for (int32_t d : ids) PCPKV_CHECK(d >= 0 && d < visible, "--gpus: device {} is not one of the {} visible", d, visible);
  PCPKV_CHECK(o.bytes >= (1 << 20) && o.bytes % 256 == 0, "bench-link: bytes = {} must be >= 1 MiB and a multiple of 256",
              o.bytes);
  PCPKV_CHECK(o.iters >= 1, "bench-link: iters = {} must be >= 1", o.iters);
  const size_t n = ids.size();
  for (size_t a = 0; a < n; ++a) {
    PCPKV_CUDA_CHECK(cudaSetDevice(ids[a]));
    for (size_t b = 0; b < n; ++b) {
      if (a == b) continue;
      int can = 0;
      PCPKV_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, ids[a], ids[b]));
      PCPKV_CHECK(can, "bench-link: GPU {} cannot access GPU {} (no peer access between them)", ids[a], ids[b]);
      const cudaError_t e = cudaDeviceEnablePeerAccess(ids[b], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        PCPKV_CUDA_CHECK(e);
      }
    }
  }
  std::vector<Gpu> g(n);
  for (size_t a = 0; a < n; ++a) {
    PCPKV_CUDA_CHECK(cudaSetDevice(ids[a]));
    g[a].device = ids[a];
    g[a].src.reset(o.bytes);
    PCPKV_CUDA_CHECK(cudaMemset(g[a].src.data(), static_cast<int>(0x11 * (a + 1)), static_cast<size_t>(o.bytes)));
    g[a].dst.resize(n);
    g[a].out.resize(n);
    for (size_t b = 0; b < n; ++b) {
      if (b != a) g[a].dst[b].reset(o.bytes);
      g[a].out[b] = std::make_unique<Stream>();
    }
    PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  }
  auto copy = [&](size_t from, size_t to) {  // on the sender's stream (the sender's copy engines push)
    PCPKV_CUDA_CHECK(cudaMemcpyPeerAsync(g[to].dst[from].data(), g[to].device, g[from].src.data(), g[from].device,
                                         static_cast<size_t>(o.bytes), g[from].out[to]->get()));
  };
  LinkBenchResult res;
  res.gpus = ids;
  res.bytes = o.bytes;
  const double gb = static_cast<double>(o.bytes) / 1e9;

  // (1) one pair, one way: GPU ids[0] -> ids[1], median of iters copies (after one warm-up).
  {
    PCPKV_CUDA_CHECK(cudaSetDevice(g[0].device));
    Event begin, end;
    cudaStream_t s = g[0].out[1]->get();
    std::vector<double> gbps;
    for (int32_t it = 0; it <= o.iters; ++it) {
      PCPKV_CUDA_CHECK(cudaEventRecord(begin.get(), s));
      copy(0, 1);
      PCPKV_CUDA_CHECK(cudaEventRecord(end.get(), s));
      PCPKV_CUDA_CHECK(cudaEventSynchronize(end.get()));
      if (it > 0) gbps.push_back(gb / (cuda::elapsed_ms(begin, end) / 1e3));
    }
    res.pair_gbps = percentile(gbps, 0.5);
  }
  // (2) and (3): a set of ordered pairs copying at once, `iters` copies each; the span is measured on GPU
  // ids[0] from a start event every stream waits on to the moment every stream has finished.
  auto concurrent = [&](const std::vector<std::pair<size_t, size_t>>& pairs) {
    PCPKV_CUDA_CHECK(cudaSetDevice(g[0].device));
    Stream control;
    Event begin, end;
    // Warm-up round (untimed), then the timed one.
    for (int round = 0; round < 2; ++round) {
      PCPKV_CUDA_CHECK(cudaSetDevice(g[0].device));
      PCPKV_CUDA_CHECK(cudaEventRecord(begin.get(), control.get()));
      std::vector<std::unique_ptr<Event>> done;
      for (const auto& [from, to] : pairs) {
        PCPKV_CUDA_CHECK(cudaSetDevice(g[from].device));
        cudaStream_t s = g[from].out[to]->get();
        PCPKV_CUDA_CHECK(cudaStreamWaitEvent(s, begin.get(), 0));
        for (int32_t it = 0; it < (round == 0 ? 1 : o.iters); ++it) copy(from, to);
        done.push_back(std::make_unique<Event>());
        PCPKV_CUDA_CHECK(cudaEventRecord(done.back()->get(), s));
      }
      PCPKV_CUDA_CHECK(cudaSetDevice(g[0].device));
      for (const auto& e : done) PCPKV_CUDA_CHECK(cudaStreamWaitEvent(control.get(), e->get(), 0));
      PCPKV_CUDA_CHECK(cudaEventRecord(end.get(), control.get()));
      PCPKV_CUDA_CHECK(cudaEventSynchronize(end.get()));
      for (const auto& e : done) PCPKV_CUDA_CHECK(cudaEventSynchronize(e->get()));
    }
    return cuda::elapsed_ms(begin, end) / 1e3;  // seconds of the timed round
  };
  {
    const double s = concurrent({{0, 1}, {1, 0}});
    res.pair_bidir_gbps = 2.0 * gb * o.iters / s;
  }
  {
    std::vector<std::pair<size_t, size_t>> pairs;
    for (size_t a = 0; a < n; ++a)
      for (size_t b = 0; b < n; ++b)
        if (a != b) pairs.emplace_back(a, b);
    const double s = concurrent(pairs);
    res.all_pairs_recv_gbps = static_cast<double>(n - 1) * gb * o.iters / s;  // per GPU, received
    res.all_pairs_total_gbps = static_cast<double>(n * (n - 1)) * gb * o.iters / s;
  }
  // Local device-to-device copy on GPU ids[0] (HBM read + write), for scale.
  {
    PCPKV_CUDA_CHECK(cudaSetDevice(g[0].device));
    Event begin, end;
    cudaStream_t s = g[0].out[0]->get();
    DeviceBuffer tmp(o.bytes);
    std::vector<double> gbps;
    for (int32_t it = 0; it <= o.iters; ++it) {
      PCPKV_CUDA_CHECK(cudaEventRecord(begin.get(), s));
      PCPKV_CUDA_CHECK(cudaMemcpyAsync(tmp.data(), g[0].src.data(), static_cast<size_t>(o.bytes),
                                       cudaMemcpyDeviceToDevice, s));
      PCPKV_CUDA_CHECK(cudaEventRecord(end.get(), s));
      PCPKV_CUDA_CHECK(cudaEventSynchronize(end.get()));
      if (it > 0) gbps.push_back(gb / (cuda::elapsed_ms(begin, end) / 1e3));
    }
    res.local_copy_gbps = percentile(gbps, 0.5);
  }
  for (size_t a = 0; a < n; ++a) {
    PCPKV_CUDA_CHECK(cudaSetDevice(g[a].device));
    PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return res;
}

}  // namespace pcpkv::cuda
