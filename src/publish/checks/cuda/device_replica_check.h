// src/publish/checks/cuda/device_replica_check.h: the run-time replica check (docs/spec.md section 5.2) of W replicas
// on one GPU: every replica's written slots hashed by launch_slot_hashes, the hashes compared with rank 0's by
// launch_compare_replica_hashes, and only the W diff records copied to the host. `pcpkv bench` times it (its
// replica-check rows); the CUDA tests compare its hashes with the CPU oracle.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "core/cuda/buffers.h"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/replica_hash.h"

namespace pcpkv::cuda {

class DeviceReplicaCheck {
 public:
  /// targets [W] the replicas (device pointers, as Publisher::targets()); slots the written slots (host; checked
  /// against every target's cache with validate_hash_slots, then uploaded once); index_slots their indexer slots
  /// where the indexer cache has its own (written_index_slots; empty: one slot addresses both caches). Throws
  /// pcpkv::Error on a bad target or slot.
  DeviceReplicaCheck(std::vector<CacheTarget> targets, const CacheFormat& fmt, std::vector<int64_t> slots,
                     std::vector<int64_t> index_slots = {});
  ~DeviceReplicaCheck();
  DeviceReplicaCheck(const DeviceReplicaCheck&) = delete;
  DeviceReplicaCheck& operator=(const DeviceReplicaCheck&) = delete;

  /// Enqueues the W hash launches, the compare and the copy of the W diffs into pinned host memory; no host
  /// synchronization (time it with events, then synchronize the stream).
  void enqueue(cudaStream_t stream);
  /// The diffs of the last enqueue(), after its stream synchronized ([W]; rank 0's always empty).
  std::vector<ReplicaHashDiff> diffs() const;
  /// Rank q's hashes of the last enqueue() ([slots]; synchronous download, for tests).
  std::vector<uint64_t> hashes(int32_t q) const;

  const std::vector<int64_t>& slots() const { return slots_; }
  const std::vector<int64_t>& index_slots() const { return index_slots_; }
  int64_t bytes_per_slot() const { return replica_hash_bytes_per_slot(fmt_); }
  /// Cache bytes the hashes read: W * slots * bytes_per_slot.
  int64_t cache_bytes_read() const;
  /// Everything read and written: the cache bytes, the slot list (read per replica), the hashes (written, then
  /// read by the compare), W * slots * (bytes_per_slot + 8 + 8 + 8).
  int64_t bytes() const;

 private:
  std::vector<CacheTarget> targets_;
  CacheFormat fmt_;
  std::vector<int64_t> slots_, index_slots_;
  DeviceBuffer d_slots_, d_index_slots_, d_hashes_, d_diffs_;
  DeviceHashDiff* host_diffs_ = nullptr;  // pinned, [W]
};

}  // namespace pcpkv::cuda
