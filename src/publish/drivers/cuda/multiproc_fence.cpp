// RankFence: see multiproc_fence.h.
#include "publish/drivers/cuda/multiproc_fence.h"

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "pcpkv/publish/kernels.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/publish/cuda_multiproc.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/fence.h"
#include "pcpkv/publish/multiproc.h"
#include "publish/drivers/publish_layout.h"

namespace pcpkv::cuda {

RankFence::RankFence(Bootstrap& group, int32_t num_barriers, int64_t timeout_ms, std::vector<int32_t> global_ranks)
    : group_(group), num_barriers_(num_barriers), timeout_ms_(timeout_ms), global_ranks_(std::move(global_ranks)) {
  PCPKV_CHECK(num_barriers >= 1, "fence: num_barriers = {} must be >= 1", num_barriers);
  PCPKV_CHECK(timeout_ms > 0, "fence: timeout_ms = {} must be > 0", timeout_ms);
  if (global_ranks_.empty())
    for (int32_t r = 0; r < group.world_size(); ++r) global_ranks_.push_back(r);
  pads_ = cuda::make_device_symmetric(group, fence_pad_bytes(num_barriers, group.world_size()), "fence pads", 0);
  epochs_.reset(int64_t{num_barriers} * 8);
  claim_.reset(4);
  PCPKV_CUDA_CHECK(cudaMemset(epochs_.data(), 0, static_cast<size_t>(epochs_.bytes())));
  PCPKV_CUDA_CHECK(cudaMemset(claim_.data(), 0, 4));
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  host_epochs_.assign(static_cast<size_t>(num_barriers), 0);
  group.barrier();  // every pad zeroed before any rank's first arrive
}

RankFence::~RankFence() = default;

void RankFence::enqueue(int32_t barrier_idx, cudaStream_t stream) {
  FenceArgs a;
  a.pads = reinterpret_cast<uint64_t* const*>(pads_->device_ptr_table());
  a.epochs = epochs_.as<uint64_t>();
  a.claim = claim_.as<uint32_t>();
  a.error = error_.device();
  a.first_rank = group_.rank();
  a.world = group_.world_size();
  a.barrier_idx = barrier_idx;
  a.num_barriers = num_barriers_;
  a.timeout_ns = static_cast<uint64_t>(timeout_ms_) * 1000000ull;
  launch_fence(a, 1, stream);
  ++host_epochs_[static_cast<size_t>(barrier_idx)];
}

void RankFence::note_replayed(int32_t barrier_idx, int64_t times) {
  host_epochs_[static_cast<size_t>(barrier_idx)] += static_cast<uint64_t>(times);
}

std::vector<uint64_t> RankFence::epochs() const {
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  return epochs_.download<uint64_t>(num_barriers_);
}

void RankFence::release_all(cudaStream_t stream) {
  // Every slot of our own pad := the highest epoch we will ever wait for; the kernel's wrap-safe ">="
  // test then lets every enqueued fence of ours pass.
  const int32_t W = group_.world_size();
  std::vector<uint64_t> values(static_cast<size_t>(fence_pad_elems(num_barriers_, W)));
  for (int32_t b = 0; b < num_barriers_; ++b)
    for (int64_t i = 0; i < 2 * W; ++i) values[static_cast<size_t>(b * 2 * W + i)] = host_epochs_[static_cast<size_t>(b)];
  cudaMemcpyAsync(pads_->local(), values.data(), values.size() * 8, cudaMemcpyHostToDevice, side_.get());
  cudaStreamSynchronize(side_.get());
  // Give the stream a bounded time to drain; a kernel that still does not finish stays the context's problem.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (cudaStreamQuery(stream) == cudaErrorNotReady && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void RankFence::wait(cudaStream_t stream, const std::string& what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto last_check = start;
  const FenceError& err = *error_.host();
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    const volatile FenceError& e = err;
    if (e.flag == kFenceErrorFlag) {
      const int32_t m = e.missing_rank;
      const std::string msg = fmt::format(
          "{}: {} never arrived at fence barrier {} epoch {} (its slot holds epoch {}); rank {} waited {} ms on the "
          "GPU (the timeout)",
          what, describe_rank(m, global_ranks_, group_.pids()), static_cast<int>(e.barrier_idx),
          static_cast<uint64_t>(e.epoch), static_cast<uint64_t>(e.seen), group_.rank(), timeout_ms_);
      release_all(stream);
      throw FenceTimeout(msg, m, fmt::format("{}:{}", __FILE__, __LINE__));
    }
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) PCPKV_CUDA_CHECK(q);
    const auto now = Clock::now();
    if (now - last_check > std::chrono::milliseconds(50)) {
      last_check = now;
      for (int32_t r = 0; r < group_.world_size(); ++r) {
        if (r == group_.rank() || process_alive(group_.pids()[static_cast<size_t>(r)])) continue;
        const std::string msg =
            fmt::format("{}: {} is gone (exited or killed) while rank {} waited for the GPU; rank {} stopped "
                        "waiting after {:.0f} ms",
                        what, describe_rank(r, global_ranks_, group_.pids()), group_.rank(), group_.rank(),
                        std::chrono::duration<double, std::milli>(now - start).count());
        release_all(stream);
        throw FenceTimeout(msg, r, fmt::format("{}:{}", __FILE__, __LINE__));
      }
      if (now - start > std::chrono::milliseconds(timeout_ms_ + 10000))
        PCPKV_FAIL("{}: the GPU work of rank {} did not finish within {} ms (fence timeout + 10 s)", what,
                   group_.rank(), timeout_ms_ + 10000);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace pcpkv::cuda
