// python/csrc/symmetric.cpp: torch.classes.pcpkv.SymmetricBuffer and its test hook set_symmetric_failure_for_test
// (schema: registry.cpp). Host memory on every build; device memory (pcpkv's VMM symmetric memory) in CUDA builds.
// Docs: pcpkv_torch/distributed.py.
#include "symmetric.h"

#include <ATen/Functions.h>
#include <torch/library.h>

#ifdef PCPKV_TORCH_CUDA
#include "pcpkv/ranks/cuda.h"
#endif

namespace pcpkv_torch {
namespace {

// Device symmetric memory on the current CUDA device: pcpkv's VMM symmetric memory (src/ranks/cuda/symmetric_vmm.cpp);
// RuntimeError in CPU-only builds. set_device_symmetric_failure: its test hook.
#ifdef PCPKV_TORCH_CUDA
std::unique_ptr<pcpkv::SymmetricMemory> make_device_symmetric(pcpkv::Bootstrap& group, int64_t bytes,
                                                              const std::string& name, uint8_t fill) {
  return pcpkv::cuda::make_device_symmetric(group, bytes, name, fill);
}
void set_device_symmetric_failure(int64_t group_rank, const std::string& why) {
  pcpkv::cuda::set_device_symmetric_failure_for_test(static_cast<int32_t>(group_rank), why);
}
#else
std::unique_ptr<pcpkv::SymmetricMemory> make_device_symmetric(pcpkv::Bootstrap&, int64_t, const std::string&,
                                                              uint8_t) {
  throw pcpkv::Error("device symmetric memory needs a CUDA build of pcpkv_torch (PCPKV_TORCH_CUDA=1)");
}
void set_device_symmetric_failure(int64_t, const std::string&) {}
#endif

}  // namespace

SymmetricHolder::SymmetricHolder(const c10::intrusive_ptr<BootstrapHolder>& boot, int64_t bytes, std::string name,
                                 int64_t fill, std::string device_type, int64_t device_index)
    : device(device_type == "cuda" ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index))
                                   : c10::Device(c10::kCPU)) {
  TORCH_CHECK_VALUE(device_type == "cpu" || device_type == "cuda", "SymmetricBuffer: device_type = '", device_type,
                    "'; expected 'cpu' or 'cuda'");
  TORCH_CHECK_VALUE(fill >= 0 && fill <= 255, "SymmetricBuffer: fill = ", fill, " must be a byte value");
  pcpkv::Bootstrap& group = boot->get("SymmetricBuffer");
  mem = runtime_errors([&]() -> std::shared_ptr<pcpkv::SymmetricMemory> {
    if (device_type == "cuda") return make_device_symmetric(group, bytes, name, static_cast<uint8_t>(fill));
    return pcpkv::make_host_symmetric(group, bytes, name, static_cast<uint8_t>(fill));
  });
}

const pcpkv::SymmetricMemory& SymmetricHolder::get(const char* what) const {
  TORCH_CHECK(mem != nullptr, "pcpkv: SymmetricBuffer.", what, ": the buffer was closed");
  return *mem;
}

at::Tensor SymmetricHolder::buffer(int64_t r) const {
  const pcpkv::SymmetricMemory& m = get("buffer");
  TORCH_CHECK_VALUE(r >= 0 && r < m.world_size(), "SymmetricBuffer.buffer: rank = ", r, " is outside [0, ",
                    m.world_size(), ")");
  std::shared_ptr<pcpkv::SymmetricMemory> keep = mem;
  return at::from_blob(m.ptr(static_cast<int32_t>(r)), {m.bytes()}, [keep](void*) {},
                       at::TensorOptions().dtype(at::kByte).device(device));
}

namespace {

void set_symmetric_failure_for_test(int64_t group_rank, std::string why, std::string device_type) {
  if (device_type == "cuda")
    set_device_symmetric_failure(group_rank, why);
  else
    pcpkv::set_host_symmetric_failure_for_test(static_cast<int32_t>(group_rank), why);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pcpkv, m) {
  m.class_<SymmetricHolder>("SymmetricBuffer")
      .def(torch::init<const c10::intrusive_ptr<BootstrapHolder>&, int64_t, std::string, int64_t, std::string,
                       int64_t>())
      .def("rank", [](const c10::intrusive_ptr<SymmetricHolder>& self) -> int64_t { return self->get("rank").rank(); })
      .def("world_size",
           [](const c10::intrusive_ptr<SymmetricHolder>& self) -> int64_t { return self->get("world_size").world_size(); })
      .def("bytes", [](const c10::intrusive_ptr<SymmetricHolder>& self) -> int64_t { return self->get("bytes").bytes(); })
      .def("ptrs",
           [](const c10::intrusive_ptr<SymmetricHolder>& self) {
             std::vector<int64_t> out;
             for (uint8_t* p : self->get("ptrs").ptrs()) out.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)));
             return out;
           })
      .def("buffer", [](const c10::intrusive_ptr<SymmetricHolder>& self, int64_t r) { return self->buffer(r); })
      .def("close", [](const c10::intrusive_ptr<SymmetricHolder>& self) { self->mem.reset(); })
      .def("closed", [](const c10::intrusive_ptr<SymmetricHolder>& self) { return self->mem == nullptr; });
}

TORCH_LIBRARY_IMPL(pcpkv, CompositeImplicitAutograd, m) {
  m.impl("set_symmetric_failure_for_test", &set_symmetric_failure_for_test);
}

}  // namespace pcpkv_torch
