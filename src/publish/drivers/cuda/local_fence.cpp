// LocalFence: see local_fence.h.
#include "publish/drivers/cuda/local_fence.h"

#include "pcpkv/publish/kernels.h"
#include "pcpkv/ranks/fence.h"

namespace pcpkv::cuda {

LocalFence::LocalFence(int32_t world, int32_t num_barriers, double timeout_ms)
    : world_(world), num_barriers_(num_barriers), timeout_ms_(timeout_ms) {
  PCPKV_CHECK(world >= 1, "fence: world = {} must be >= 1", world);
  PCPKV_CHECK(num_barriers >= 1, "fence: num_barriers = {} must be >= 1", num_barriers);
  PCPKV_CHECK(timeout_ms > 0.0, "fence: timeout_ms = {} must be > 0", timeout_ms);
  const int64_t pad_bytes = fence_pad_bytes(num_barriers, world);
  pads_.reset(pad_bytes * world);
  std::vector<uint64_t*> table(static_cast<size_t>(world));
  for (int32_t r = 0; r < world; ++r) table[static_cast<size_t>(r)] = pads_.as<uint64_t>() + fence_pad_elems(num_barriers, world) * r;
  pad_table_ = DeviceBuffer::from(table);
  epochs_.reset(int64_t{world} * num_barriers * 8);
  claim_.reset(4);
  reset();
}

void LocalFence::reset() {
  PCPKV_CUDA_CHECK(cudaMemset(pads_.data(), 0, static_cast<size_t>(pads_.bytes())));
  PCPKV_CUDA_CHECK(cudaMemset(epochs_.data(), 0, static_cast<size_t>(epochs_.bytes())));
  PCPKV_CUDA_CHECK(cudaMemset(claim_.data(), 0, 4));
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  *error_.host() = FenceError{};
}

void LocalFence::enqueue_ranks(int32_t barrier_idx, int32_t first_rank, int32_t num_ranks, cudaStream_t stream,
                               bool pdl) {
  FenceArgs a;
  a.pads = pad_table_.as<uint64_t* const>();
  a.epochs = epochs_.as<uint64_t>() + int64_t{first_rank} * num_barriers_;
  a.claim = claim_.as<uint32_t>();
  a.error = error_.device();
  a.first_rank = first_rank;
  a.world = world_;
  a.barrier_idx = barrier_idx;
  a.num_barriers = num_barriers_;
  a.timeout_ns = static_cast<uint64_t>(timeout_ms_ * 1e6);
  launch_fence(a, num_ranks, stream, pdl);
}

void LocalFence::check() const { throw_if_fence_timeout(*error_.host(), timeout_ms_); }

std::vector<uint64_t> LocalFence::epochs() const {
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  return epochs_.download<uint64_t>(int64_t{world_} * num_barriers_);
}

}  // namespace pcpkv::cuda
