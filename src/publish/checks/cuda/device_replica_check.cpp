// DeviceReplicaCheck (src/publish/checks/cuda/device_replica_check.h): W replicas of one GPU hashed and compared there.
#include "publish/checks/cuda/device_replica_check.h"

#include <algorithm>
#include <utility>

#include "pcpkv/core/error.h"

namespace pcpkv::cuda {

DeviceReplicaCheck::DeviceReplicaCheck(std::vector<CacheTarget> targets, const CacheFormat& fmt,
                                       std::vector<int64_t> slots, std::vector<int64_t> index_slots)
    : targets_(std::move(targets)), fmt_(fmt), slots_(std::move(slots)), index_slots_(std::move(index_slots)) {
  PCPKV_CHECK(!targets_.empty(), "replica check: no replicas");
  const int64_t W = static_cast<int64_t>(targets_.size());
  const int64_t n = static_cast<int64_t>(slots_.size());
  const bool own = !index_slots_.empty();
  PCPKV_CHECK(!own || index_slots_.size() == slots_.size(), "replica check: index_slots has {} entries, slots {}",
              index_slots_.size(), slots_.size());
  for (const CacheTarget& t : targets_) {
    validate_hash_slots(slots_.data(), n, t.mla.num_slots(), "slots", own);
    if (own && fmt_.has_indexer) validate_hash_slots(index_slots_.data(), n, t.index.num_slots(), "index_slots", true);
  }
  d_slots_ = DeviceBuffer::from(slots_.empty() ? std::vector<int64_t>{0} : slots_);
  if (own) d_index_slots_ = DeviceBuffer::from(index_slots_);
  d_hashes_.reset(std::max<int64_t>(1, W * n) * static_cast<int64_t>(sizeof(uint64_t)));
  d_diffs_.reset(W * static_cast<int64_t>(sizeof(DeviceHashDiff)));
  // Refused here rather than at the first enqueue (the launcher checks the same).
  for (const CacheTarget& t : targets_)
    validate_slot_hashes_shape(t, fmt_, d_slots_.as<const int64_t>(), n, d_hashes_.as<const uint64_t>(),
                               own ? d_index_slots_.as<const int64_t>() : nullptr);
  PCPKV_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_diffs_), static_cast<size_t>(W) * sizeof(DeviceHashDiff)));
  for (int64_t q = 0; q < W; ++q) host_diffs_[q] = DeviceHashDiff{0ull, ~0ull};
}

DeviceReplicaCheck::~DeviceReplicaCheck() {
  if (host_diffs_) cudaFreeHost(host_diffs_);
}

void DeviceReplicaCheck::enqueue(cudaStream_t stream) {
  const int32_t W = static_cast<int32_t>(targets_.size());
  const int64_t n = static_cast<int64_t>(slots_.size());
  for (int32_t q = 0; q < W; ++q) {
    const CacheTarget& t = targets_[static_cast<size_t>(q)];
    uint64_t* h = d_hashes_.as<uint64_t>() + int64_t{q} * n;
    if (index_slots_.empty())
      launch_slot_hashes(t, fmt_, d_slots_.as<const int64_t>(), n, h, stream);
    else
      launch_slot_hashes_own_index(t, fmt_, d_slots_.as<const int64_t>(), d_index_slots_.as<const int64_t>(), n, h,
                                   stream);
  }
  launch_compare_replica_hashes(d_hashes_.as<const uint64_t>(), W, n, d_diffs_.as<DeviceHashDiff>(), stream);
  PCPKV_CUDA_CHECK(cudaMemcpyAsync(host_diffs_, d_diffs_.data(), static_cast<size_t>(W) * sizeof(DeviceHashDiff),
                                   cudaMemcpyDeviceToHost, stream));
}

std::vector<ReplicaHashDiff> DeviceReplicaCheck::diffs() const {
  std::vector<ReplicaHashDiff> out(targets_.size());
  for (size_t q = 0; q < targets_.size(); ++q) {
    out[q].num_diff = static_cast<int64_t>(host_diffs_[q].num_diff);
    out[q].first = host_diffs_[q].num_diff == 0 ? -1 : static_cast<int64_t>(host_diffs_[q].first);
  }
  return out;
}

std::vector<uint64_t> DeviceReplicaCheck::hashes(int32_t q) const {
  PCPKV_CHECK(q >= 0 && q < static_cast<int32_t>(targets_.size()), "replica check: rank {} is outside [0, {})", q,
              targets_.size());
  const int64_t n = static_cast<int64_t>(slots_.size());
  std::vector<uint64_t> h(static_cast<size_t>(n));
  if (n > 0)
    PCPKV_CUDA_CHECK(cudaMemcpy(h.data(), d_hashes_.as<uint64_t>() + int64_t{q} * n, h.size() * sizeof(uint64_t),
                                cudaMemcpyDeviceToHost));
  return h;
}

int64_t DeviceReplicaCheck::cache_bytes_read() const {
  return static_cast<int64_t>(targets_.size()) * static_cast<int64_t>(slots_.size()) * bytes_per_slot();
}

int64_t DeviceReplicaCheck::bytes() const {
  return static_cast<int64_t>(targets_.size()) * static_cast<int64_t>(slots_.size()) * (bytes_per_slot() + 24);
}

}  // namespace pcpkv::cuda
