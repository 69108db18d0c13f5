// NCCL all-gathers for the collect transport across processes (see NcclAllGather in pcpkv/publish/cuda_multiproc.h).
// Guarded by PCPKV_HAVE_NCCL: without NCCL the constructor explains that it is missing.
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/cuda/check.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/ranks/cuda.h"
#include "pcpkv/core/error.h"
#include "ranks/nccl_env.h"

#if defined(PCPKV_HAVE_NCCL)
#include <nccl.h>
#endif

namespace pcpkv::cuda {

bool have_nccl() {
#if defined(PCPKV_HAVE_NCCL)
  return true;
#else
  return false;
#endif
}

struct NcclAllGather::Impl {
#if defined(PCPKV_HAVE_NCCL)
  ncclComm_t comm = nullptr;
#endif
};

namespace {

// A GPU's identity across processes: its UUID (indices differ with CUDA_VISIBLE_DEVICES).
struct GpuId {
  char uuid[16];
  int32_t device;
  int32_t pad;
};

std::string uuid_text(const char* u) {
  std::string s;
  for (int i = 0; i < 16; ++i) s += fmt::format("{:02x}", static_cast<uint8_t>(u[i]));
  return "GPU-" + s.substr(0, 8) + "-" + s.substr(8, 4) + "-" + s.substr(12, 4) + "-" + s.substr(16, 4) + "-" +
         s.substr(20);
}

}  // namespace

NcclAllGather::NcclAllGather(Bootstrap& group) : impl_(std::make_unique<Impl>()) {
  nccl_env::keep_nccl_nvls_off();  // before any collective: a refused value fails here, on the rank that has it
  const int32_t world = group.world_size();
  // Every rank's GPU, so that every rank reaches the same verdict before NCCL is touched.
  GpuId mine{};
  int device = -1;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  PCPKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::memcpy(mine.uuid, prop.uuid.bytes, 16);
  mine.device = device;
  std::vector<GpuId> all(static_cast<size_t>(world));
  group.all_gather(&mine, sizeof(mine), all.data());
  std::map<std::string, std::vector<int32_t>> by_gpu;
  for (int32_t r = 0; r < world; ++r) by_gpu[std::string(all[static_cast<size_t>(r)].uuid, 16)].push_back(r);
  for (const auto& [uuid, ranks] : by_gpu)
    PCPKV_CHECK(ranks.size() == 1,
                "collect over NCCL needs one GPU per rank: ranks {} all use {} (device {} of rank {}); NCCL refuses "
                "two ranks of one communicator on one GPU ('Duplicate GPU detected'). With several ranks per GPU "
                "use the staging or direct transport (symmetric memory), or collect with p2p all-gathers "
                "(--collect-via p2p)",
                fmt::join(ranks, ", "), uuid_text(uuid.data()), all[static_cast<size_t>(ranks[0])].device, ranks[0]);
#if defined(PCPKV_HAVE_NCCL)
  ncclUniqueId id{};
  if (group.rank() == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    PCPKV_CHECK(r == ncclSuccess, "ncclGetUniqueId failed: {}", ncclGetErrorString(r));
  }
  std::vector<ncclUniqueId> ids(static_cast<size_t>(world));
  group.all_gather(&id, sizeof(id), ids.data());
  const ncclResult_t r = ncclCommInitRank(&impl_->comm, world, ids[0], group.rank());
  PCPKV_CHECK(r == ncclSuccess, "ncclCommInitRank (rank {} of {}) failed: {}{}", group.rank(), world,
              ncclGetErrorString(r), ncclGetLastError(nullptr) ? fmt::format(": {}", ncclGetLastError(nullptr)) : "");
#else
  PCPKV_FAIL("collect over NCCL: this pcpkv was built without NCCL (nccl.h / libnccl not found at configure time); "
             "use --collect-via p2p, or the staging or direct transport");
#endif
}

NcclAllGather::~NcclAllGather() {
#if defined(PCPKV_HAVE_NCCL)
  if (impl_ && impl_->comm) ncclCommDestroy(impl_->comm);
#endif
}

void NcclAllGather::all_gather(const void* send, void* recv, int64_t bytes, void* stream) {
#if defined(PCPKV_HAVE_NCCL)
  const ncclResult_t r = ncclAllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, impl_->comm,
                                       static_cast<cudaStream_t>(stream));
  PCPKV_CHECK(r == ncclSuccess, "ncclAllGather of {} bytes failed: {}", bytes, ncclGetErrorString(r));
#else
  (void)send;
  (void)recv;
  (void)bytes;
  (void)stream;
  PCPKV_FAIL("NCCL all-gather: built without NCCL");
#endif
}

}  // namespace pcpkv::cuda
