// src/publish/drivers/cuda/local_fence.h: the SPEC section 5 fence for W logical ranks that live in this process on one
// GPU. Owns the W signal pads (device memory, zeroed), the device pad table, the device-resident epochs
// [W][num_barriers], the claim word and the host-mapped FenceError. enqueue() launches the fence kernel with one block
// per rank (all co-resident), so it is safe inside CUDA graphs: each replay advances the epochs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "core/cuda/buffers.h"
#include "pcpkv/device/fence_kernel.h"

namespace pcpkv::cuda {

class LocalFence {
 public:
  /// Throws pcpkv::Error on world < 1 or num_barriers < 1.
  LocalFence(int32_t world, int32_t num_barriers, double timeout_ms);

  /// All W ranks arrive at barrier barrier_idx (one launch of W blocks). pdl: launch with programmatic stream
  /// serialization (the kernel waits for the previous kernel before it signals).
  void enqueue(int32_t barrier_idx, cudaStream_t stream, bool pdl = false) {
    enqueue_ranks(barrier_idx, 0, world_, stream, pdl);
  }
  /// Only ranks [first_rank, first_rank + num_ranks) arrive (tests: a missing rank times out).
  void enqueue_ranks(int32_t barrier_idx, int32_t first_rank, int32_t num_ranks, cudaStream_t stream,
                     bool pdl = false);

  /// After the stream that ran the fence synchronized: throws pcpkv::FenceTimeout naming the missing rank.
  void check() const;
  /// Zeroes pads, epochs, claim and the error (synchronous). Needed after a timeout.
  void reset();
  /// Device epochs [W][num_barriers] (synchronous read).
  std::vector<uint64_t> epochs() const;

  int32_t world() const { return world_; }
  double timeout_ms() const { return timeout_ms_; }

 private:
  int32_t world_;
  int32_t num_barriers_;
  double timeout_ms_;
  DeviceBuffer pads_;       // [W][num_barriers][2][W] uint64
  DeviceBuffer pad_table_;  // [W] uint64_t*
  DeviceBuffer epochs_;     // [W][num_barriers] uint64
  DeviceBuffer claim_;      // uint32
  HostMapped<FenceError> error_;
};

}  // namespace pcpkv::cuda
