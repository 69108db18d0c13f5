// src/publish/drivers/cuda/multiproc_fence.h: this process's side of the SPEC section 5 fence between rank processes:
// the signal pads in device symmetric memory (VMM, every peer's pad mapped), this rank's device-resident epochs, the
// claim word and a host-mapped FenceError. enqueue() launches the cuda engineer's fence kernel with one block acting as
// this rank (graph-capturable; each replay advances the device epochs).
//
// wait() synchronizes a stream while watching the peers: it turns the kernel's error word into
// pcpkv::FenceTimeout naming the missing rank, and reports a peer process that died at once (without
// waiting for the kernel's own timeout). Either way it first releases every fence this rank has enqueued
// (it writes the highest epoch into both parity slots of its own pad), so the stream drains and the
// process can tear down and exit promptly instead of hanging in a spinning kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda/buffers.h"
#include "pcpkv/device/fence_kernel.h"
#include "pcpkv/ranks/symmetric.h"

namespace pcpkv {
class Bootstrap;
}

namespace pcpkv::cuda {

class RankFence {
 public:
  /// Collective over group (allocates the pads). timeout_ms bounds every wait on the device and on the host.
  RankFence(Bootstrap& group, int32_t num_barriers, int64_t timeout_ms, std::vector<int32_t> global_ranks);
  ~RankFence();

  /// This rank arrives at barrier_idx and waits for every peer, on `stream`.
  void enqueue(int32_t barrier_idx, cudaStream_t stream);
  /// Accounts for `times` more enqueues of a fence at barrier_idx done by graph replays (host mirror of
  /// the device epochs, used to release a stuck stream).
  void note_replayed(int32_t barrier_idx, int64_t times);
  /// Synchronizes `stream` (see the header comment). `what` prefixes messages ("publish (direct)").
  void wait(cudaStream_t stream, const std::string& what);
  /// Device epochs [num_barriers] (synchronous).
  std::vector<uint64_t> epochs() const;
  int32_t num_barriers() const { return num_barriers_; }

 private:
  void release_all(cudaStream_t stream);

  Bootstrap& group_;
  int32_t num_barriers_;
  int64_t timeout_ms_;
  std::vector<int32_t> global_ranks_;
  std::unique_ptr<SymmetricMemory> pads_;
  DeviceBuffer epochs_;  // [num_barriers] uint64, this rank's
  DeviceBuffer claim_;   // uint32
  HostMapped<FenceError> error_;
  std::vector<uint64_t> host_epochs_;  // [num_barriers] what the device epochs will be once the stream drains
  Stream side_;          // for releasing a stuck fence while the main stream is blocked
};

}  // namespace pcpkv::cuda
