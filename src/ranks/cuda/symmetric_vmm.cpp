// Device symmetric memory over the CUDA VMM API with POSIX file-descriptor export (see
// pcpkv/publish/cuda_multiproc.h). Every failure during setup is turned into a reason string and agreed on by all
// ranks (Bootstrap::agree), so setup either succeeds everywhere or fails everywhere with the same message.
//
// The driver API is reached through cudaGetDriverEntryPointByVersion, not by linking libcuda: binaries then
// start on machines without a driver (CI) and report "no CUDA device" instead of failing to load.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <type_traits>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda/check.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/ranks/cuda.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/symmetric.h"

namespace pcpkv::cuda {
namespace {

std::atomic<int32_t> g_fail_rank{-1};
std::string g_fail_why;

// Driver entry points, loaded once through the runtime.
struct Driver {
  decltype(&::cuGetErrorName) GetErrorName = nullptr;
  decltype(&::cuGetErrorString) GetErrorString = nullptr;
  decltype(&::cuDeviceGet) DeviceGet = nullptr;
  decltype(&::cuDeviceGetAttribute) DeviceGetAttribute = nullptr;
  decltype(&::cuMemGetAllocationGranularity) MemGetAllocationGranularity = nullptr;
  decltype(&::cuMemCreate) MemCreate = nullptr;
  decltype(&::cuMemExportToShareableHandle) MemExportToShareableHandle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) MemImportFromShareableHandle = nullptr;
  decltype(&::cuMemAddressReserve) MemAddressReserve = nullptr;
  decltype(&::cuMemMap) MemMap = nullptr;
  decltype(&::cuMemSetAccess) MemSetAccess = nullptr;
  decltype(&::cuMemUnmap) MemUnmap = nullptr;
  decltype(&::cuMemAddressFree) MemAddressFree = nullptr;
  decltype(&::cuMemRelease) MemRelease = nullptr;
  std::string error;  // non-empty: some entry point is missing
};

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    auto load = [&x](const char* name, auto** fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult status{};
      const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status);
      if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr) {
        if (x.error.empty())
          x.error = fmt::format("the CUDA driver entry point {} is not available ({})", name, cudaGetErrorString(e));
        cudaGetLastError();
        return;
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
    };
    load("cuGetErrorName", &x.GetErrorName);
    load("cuGetErrorString", &x.GetErrorString);
    load("cuDeviceGet", &x.DeviceGet);
    load("cuDeviceGetAttribute", &x.DeviceGetAttribute);
    load("cuMemGetAllocationGranularity", &x.MemGetAllocationGranularity);
    load("cuMemCreate", &x.MemCreate);
    load("cuMemExportToShareableHandle", &x.MemExportToShareableHandle);
    load("cuMemImportFromShareableHandle", &x.MemImportFromShareableHandle);
    load("cuMemAddressReserve", &x.MemAddressReserve);
    load("cuMemMap", &x.MemMap);
    load("cuMemSetAccess", &x.MemSetAccess);
    load("cuMemUnmap", &x.MemUnmap);
    load("cuMemAddressFree", &x.MemAddressFree);
    load("cuMemRelease", &x.MemRelease);
    return x;
  }();
  return d;
}

std::string cu_error(CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver().GetErrorName) driver().GetErrorName(r, &name);
  if (driver().GetErrorString) driver().GetErrorString(r, &text);
  return fmt::format("{} ({})", name ? name : "CUDA_ERROR_?", text ? text : "?");
}

// "" on success, else "<what> failed: <error>".
std::string cu_try(CUresult r, const std::string& what) {
  return r == CUDA_SUCCESS ? std::string() : fmt::format("{} failed: {}", what, cu_error(r));
}

class DeviceSymmetric final : public SymmetricMemory {
 public:
  DeviceSymmetric(std::string name, int32_t rank, int64_t bytes, int32_t world, int device)
      : SymmetricMemory(std::move(name), rank, bytes), device_(device) {
    ptrs_.assign(static_cast<size_t>(world), nullptr);
    handles_.assign(static_cast<size_t>(world), 0);
    mapped_.assign(static_cast<size_t>(world), false);
    reserved_.assign(static_cast<size_t>(world), false);
    have_handle_.assign(static_cast<size_t>(world), false);
  }
  ~DeviceSymmetric() override { release(); }

  bool on_device() const override { return true; }
  uint8_t* const* device_ptr_table() const override { return table_; }

  // Everything below returns "" or the reason it failed.
  std::string init(int64_t requested) {
    if (!driver().error.empty()) return driver().error;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device_;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop_ = prop;
    int vmm = 0, fd_ok = 0;
    CUdevice dev = 0;
    if (auto w = cu_try(driver().DeviceGet(&dev, device_), "cuDeviceGet"); !w.empty()) return w;
    driver().DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
    driver().DeviceGetAttribute(&fd_ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
    if (!vmm) return fmt::format("GPU {} does not support the CUDA virtual memory management API", device_);
    if (!fd_ok) return fmt::format("GPU {} cannot export memory as POSIX file descriptors", device_);
    size_t gran = 0;
    if (auto w = cu_try(driver().MemGetAllocationGranularity(&gran, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                        "cuMemGetAllocationGranularity");
        !w.empty())
      return w;
    granularity_ = gran;
    map_bytes_ = (static_cast<size_t>(requested) + gran - 1) / gran * gran;
    return {};
  }

  std::string create_local(uint8_t fill, UniqueFd* fd) {
    const size_t me = static_cast<size_t>(rank_);
    if (auto w = cu_try(driver().MemCreate(&handles_[me], map_bytes_, &prop_, 0),
                        fmt::format("cuMemCreate of {} bytes on GPU {}", map_bytes_, device_));
        !w.empty())
      return w;
    have_handle_[me] = true;
    int raw = -1;
    if (auto w = cu_try(driver().MemExportToShareableHandle(&raw, handles_[me], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                        "cuMemExportToShareableHandle (POSIX fd)");
        !w.empty())
      return w;
    fd->reset(raw);
    if (auto w = map(rank_); !w.empty()) return w;
    if (cudaMemset(ptrs_[me], fill, map_bytes_) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
      return fmt::format("filling the local buffer failed: {}", cudaGetErrorString(cudaGetLastError()));
    return {};
  }

  std::string import_peer(int32_t r, int fd) {
    const size_t i = static_cast<size_t>(r);
    if (auto w = cu_try(driver().MemImportFromShareableHandle(&handles_[i], reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                        fmt::format("cuMemImportFromShareableHandle of rank {}'s buffer", r));
        !w.empty())
      return w;
    have_handle_[i] = true;
    return map(r);
  }

  std::string make_table() {
    if (cudaMalloc(&table_raw_, ptrs_.size() * sizeof(uint8_t*)) != cudaSuccess)
      return "cudaMalloc of the peer pointer table failed";
    table_ = static_cast<uint8_t* const*>(table_raw_);
    if (cudaMemcpy(table_raw_, ptrs_.data(), ptrs_.size() * sizeof(uint8_t*), cudaMemcpyHostToDevice) != cudaSuccess)
      return "uploading the peer pointer table failed";
    return {};
  }

 private:
  std::string map(int32_t r) {
    const size_t i = static_cast<size_t>(r);
    CUdeviceptr va = 0;
    if (auto w = cu_try(driver().MemAddressReserve(&va, map_bytes_, granularity_, 0, 0),
                        fmt::format("cuMemAddressReserve for rank {}'s buffer", r));
        !w.empty())
      return w;
    ptrs_[i] = reinterpret_cast<uint8_t*>(va);
    reserved_[i] = true;
    if (auto w = cu_try(driver().MemMap(va, map_bytes_, 0, handles_[i], 0), fmt::format("cuMemMap of rank {}'s buffer", r));
        !w.empty())
      return w;
    mapped_[i] = true;
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (auto w = cu_try(driver().MemSetAccess(va, map_bytes_, &access, 1),
                        fmt::format("cuMemSetAccess of rank {}'s buffer from GPU {} (no peer access between the "
                                    "two GPUs?)",
                                    r, device_));
        !w.empty())
      return w;
    return {};
  }

  void release() noexcept {
    if (table_raw_) cudaFree(table_raw_);
    table_raw_ = nullptr;
    table_ = nullptr;
    // Nothing of ours may still run on these mappings.
    cudaDeviceSynchronize();
    for (size_t i = 0; i < ptrs_.size(); ++i) {
      const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(ptrs_[i]);
      if (mapped_[i]) driver().MemUnmap(va, map_bytes_);
      if (reserved_[i]) driver().MemAddressFree(va, map_bytes_);
      if (have_handle_[i]) driver().MemRelease(handles_[i]);
      mapped_[i] = reserved_[i] = have_handle_[i] = false;
      ptrs_[i] = nullptr;
    }
  }

  int device_;
  CUmemAllocationProp prop_{};
  size_t granularity_ = 0;
  size_t map_bytes_ = 0;
  std::vector<CUmemGenericAllocationHandle> handles_;
  std::vector<bool> mapped_, reserved_, have_handle_;
  void* table_raw_ = nullptr;
  uint8_t* const* table_ = nullptr;
};

}  // namespace

void set_device_symmetric_failure_for_test(int32_t group_rank, const std::string& why) {
  g_fail_why = why;
  g_fail_rank = group_rank;
}

std::unique_ptr<SymmetricMemory> make_device_symmetric(Bootstrap& group, int64_t bytes, const std::string& name,
                                                       uint8_t fill) {
  const int32_t world = group.world_size();
  const int32_t me = group.rank();
  const std::string what = fmt::format("device symmetric memory '{}' ({} bytes per rank, {} ranks)", name, bytes, world);
  agree_symmetric_size(group, bytes, what);
  int device = -1;
  std::string why;
  if (cudaGetDevice(&device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess)  // make the primary context current
    why = fmt::format("no usable CUDA device: {}", cudaGetErrorString(cudaGetLastError()));
  auto mem = std::make_unique<DeviceSymmetric>(name, me, bytes, world, device);
  UniqueFd fd;
  if (why.empty()) why = mem->init(bytes);
  if (why.empty()) why = mem->create_local(fill, &fd);
  group.agree(why.empty(), why, what + ": create");

  std::vector<UniqueFd> fds = group.all_gather_fds(fd.get());
  fd.reset();
  why.clear();
  if (g_fail_rank.load() == me) why = g_fail_why.empty() ? "injected failure (test)" : g_fail_why;
  for (int32_t r = 0; r < world && why.empty(); ++r)
    if (r != me) why = mem->import_peer(r, fds[static_cast<size_t>(r)].get());
  fds.clear();  // imported handles keep the memory; no descriptor outlives setup
  if (why.empty()) why = mem->make_table();
  group.agree(why.empty(), why, what + ": map peers");
  return mem;
}

}  // namespace pcpkv::cuda
