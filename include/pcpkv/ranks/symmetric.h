// pcpkv/ranks/symmetric.h: symmetric memory, one buffer per rank of a group, mapped by every rank (SPEC section 5).
//
// Every rank allocates `bytes` and exports it as a file descriptor; the descriptors travel to every rank
// over the bootstrap socket (SCM_RIGHTS) and each rank maps all of them. Setup is all-or-nothing: each rank
// reports whether it mapped every peer, and unless all did, every rank unmaps what it has and throws a
// pcpkv::Error naming each failing rank and its reason. Teardown (the destructor) unmaps every mapping
// and closes every descriptor; it is local and needs no peer (a peer may already be gone).
//
// Two implementations share this interface:
//  * host memory: POSIX shared memory (shm_open, mode 0600, unlinked as soon as it is open, so nothing
//    is left in /dev/shm even if a rank is killed), mmap'd MAP_SHARED; make_host_symmetric below;
//  * device memory (CUDA builds): cuMemCreate + POSIX-FD export, cuMemMap of every peer, and a device
//    table of peer pointers; pcpkv/publish/cuda_multiproc.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pcpkv {

class Bootstrap;

class SymmetricMemory {
 public:
  virtual ~SymmetricMemory() = default;
  /// Group rank of this process and group size (those of the Bootstrap it was made with).
  int32_t rank() const { return rank_; }
  int32_t world_size() const { return static_cast<int32_t>(ptrs_.size()); }
  /// Bytes of each rank's buffer (the requested size; the mapping may be rounded up).
  int64_t bytes() const { return bytes_; }
  /// This process's address of rank r's buffer: a host pointer (host memory) or a device pointer.
  uint8_t* ptr(int32_t r) const;
  uint8_t* local() const { return ptrs_[rank_]; }
  /// [world_size] addresses, ptrs()[r] == ptr(r).
  const std::vector<uint8_t*>& ptrs() const { return ptrs_; }
  /// Device memory: a device array [world_size] of uint8_t* holding ptrs() (null for host memory).
  virtual uint8_t* const* device_ptr_table() const { return nullptr; }
  virtual bool on_device() const = 0;
  const std::string& name() const { return name_; }

 protected:
  SymmetricMemory(std::string name, int32_t rank, int64_t bytes) : name_(std::move(name)), rank_(rank), bytes_(bytes) {}
  std::string name_;
  int32_t rank_ = 0;
  int64_t bytes_ = 0;
  std::vector<uint8_t*> ptrs_;
};

/// Host symmetric memory over POSIX shared memory, for the CPU backend with one process per rank.
/// Collective over `group`: every rank must call it with the same `bytes` (> 0). `name` names the buffer
/// in messages ("staging", "caches"). The local buffer is filled with `fill` before any peer maps it.
/// Throws pcpkv::Error on every rank when any rank fails (see the header comment), or when the ranks
/// disagree on `bytes`.
std::unique_ptr<SymmetricMemory> make_host_symmetric(Bootstrap& group, int64_t bytes, const std::string& name,
                                                     uint8_t fill = 0);

/// The size check of every symmetric allocation (host and device): all-gathers `bytes` over `group` and
/// throws pcpkv::Error, on every rank alike, naming `what` and the first rank whose size differs from rank 0's
/// or is not > 0 (a smaller peer buffer would be written out of bounds). Collective.
void agree_symmetric_size(Bootstrap& group, int64_t bytes, const std::string& what);

/// Test hook: when set (>= 0), make_host_symmetric on this group rank fails to map the peer buffers, with
/// reason `why`, so that tests can check the all-or-nothing agreement. -1 (default): off.
void set_host_symmetric_failure_for_test(int32_t group_rank, const std::string& why);

/// Counts of this process's open descriptors and of its shared-memory mappings (/proc/self/fd and the
/// /dev/shm lines of /proc/self/maps), for leak checks.
struct ResourceCounts {
  int64_t open_fds = 0;
  int64_t shm_mappings = 0;
  int64_t device_mappings = 0;  // /proc/self/maps lines of /dev/nvidia* (CUDA contexts map these)
};
ResourceCounts count_process_resources();

}  // namespace pcpkv
