// pcpkv/ranks/cuda.h: rank processes on CUDA devices (CUDA builds only; no CUDA headers needed).
//
// Processes must fork before they touch CUDA; `pcpkv launch` starts fresh processes, so any rank may. Each
// rank uses device PCPKV_DEVICE, or local_rank % visible devices (round-robin: several ranks may share one
// GPU). Symmetric device memory is allocated with the CUDA VMM API (cuMemCreate, exported as a POSIX file
// descriptor, passed over the bootstrap socket with SCM_RIGHTS, imported and cuMemMap'd by every rank) and
// works between processes on one GPU and between GPUs with peer access. NVLink multicast is never used.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pcpkv/ranks/symmetric.h"

namespace pcpkv {
class Bootstrap;
}

namespace pcpkv::cuda {

/// Picks and sets this rank's device (PCPKV_DEVICE, else local_rank % visible devices, or device_idx >= 0)
/// and returns it. Throws pcpkv::Error when no device is visible.
int32_t select_rank_device(const Bootstrap& world, int32_t device_idx = -1);

/// Device symmetric memory on the current device (see the header comment): every rank maps every peer or
/// all ranks throw, naming each failing rank and its reason (e.g. "rank 1: cuMemSetAccess of rank 3's
/// buffer (GPU 3) from GPU 1 failed: CUDA_ERROR_INVALID_DEVICE (no peer access between these GPUs?)").
/// The local buffer is filled with `fill` before any peer maps it. device_ptr_table() is a device array
/// [world] of every rank's address. Teardown unmaps, frees the address ranges, releases the handles and
/// closes every descriptor (no descriptor outlives setup).
std::unique_ptr<SymmetricMemory> make_device_symmetric(Bootstrap& group, int64_t bytes, const std::string& name,
                                                       uint8_t fill = 0);

/// Test hook: make_device_symmetric on this group rank fails to map its peers with reason `why` (-1: off).
void set_device_symmetric_failure_for_test(int32_t group_rank, const std::string& why);

/// NCCL all-gather for the collect transport across processes (one GPU per rank).
class NcclAllGather {
 public:
  /// Collective over group. Throws pcpkv::Error when pcpkv was built without NCCL, or when two ranks share
  /// a GPU ("collect over NCCL needs one GPU per rank: ranks 0 and 1 both use GPU 0 (...); NCCL refuses
  /// that ('Duplicate GPU detected'); the staging and direct transports, and collect with p2p all-gathers,
  /// work with several ranks per GPU"), or when NCCL fails (its message included).
  explicit NcclAllGather(Bootstrap& group);
  ~NcclAllGather();
  NcclAllGather(const NcclAllGather&) = delete;
  NcclAllGather& operator=(const NcclAllGather&) = delete;
  /// recv[r * bytes + i] = send of rank r [i], on `stream` (a cudaStream_t; graph-capturable).
  void all_gather(const void* send, void* recv, int64_t bytes, void* stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Free memory of the current device in bytes (cudaMemGetInfo), for leak checks.
int64_t device_free_bytes();

/// Whether pcpkv_cuda was built with NCCL.
bool have_nccl();

/// This rank's row of its group's peer-access matrix (transport "auto", pcpkv/publish/transport_choice.h):
/// row[b] is true when rank b uses this rank's current GPU (same UUID) or a GPU this one has CUDA peer access
/// to (cudaDeviceCanAccessPeer; the peer's GPU found by its PCI bus id, false when this process cannot see
/// it). Collective over group (one all-gather).
std::vector<bool> peer_access_row(Bootstrap& group);

}  // namespace pcpkv::cuda
