// python/csrc/bootstrap.cpp: torch.classes.pcpkv.Bootstrap and the host ops around it (make_job_token,
// resource_counts; schemas: registry.cpp). Docs: pcpkv_torch/distributed.py.
#include "bootstrap.h"

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <vector>

#include "pcpkv/core/interrupt.h"
#include "pcpkv/ranks/symmetric.h"

namespace pcpkv_torch {
namespace {

// The long waits (the rendezvous, the collectives, the CPU fence) run with the GIL released and retry on EINTR,
// so Python's SIGINT handler only recorded Ctrl-C and KeyboardInterrupt came at the wait's timeout. They call this
// at least every pcpkv::kInterruptPollMs: it takes the GIL briefly and runs the pending signal handlers (main thread
// only, as Python does); an exception they raise is passed on as itself (KeyboardInterrupt).
void run_python_signal_handlers() {
  if (!Py_IsInitialized()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  if (PyErr_CheckSignals() == 0) {
    PyGILState_Release(gil);
    return;
  }
  pybind11::error_already_set raised;  // takes the exception while the GIL is held; pybind11 restores it
  PyGILState_Release(gil);
  throw raised;
}

[[maybe_unused]] const bool g_interrupt_check_set = (pcpkv::set_interrupt_check(&run_python_signal_handlers), true);

}  // namespace

BootstrapHolder::BootstrapHolder(int64_t rank, int64_t world_size, std::string address, std::string token,
                                 std::string job, double timeout_s) {
  pcpkv::BootstrapConfig cfg;
  cfg.rank = static_cast<int32_t>(rank);
  cfg.world_size = static_cast<int32_t>(world_size);
  cfg.local_rank = cfg.rank;  // one host: the group is the host's processes
  cfg.local_world_size = cfg.world_size;
  cfg.address = std::move(address);
  cfg.token = std::move(token);
  cfg.job = std::move(job);
  cfg.timeout_s = timeout_s;
  cfg.source = "torch.distributed";
  boot = runtime_errors([&] { return pcpkv::Bootstrap::connect(cfg); });
}

pcpkv::Bootstrap& BootstrapHolder::get(const char* what) const {
  TORCH_CHECK(boot != nullptr, "pcpkv: Bootstrap.", what, ": the bootstrap was closed");
  return *boot;
}

namespace {

std::string make_job_token() { return pcpkv::make_job_token(); }

// [open descriptors, /dev/shm mappings, /dev/nvidia* mappings] of this process (leak checks).
std::vector<int64_t> resource_counts() {
  const pcpkv::ResourceCounts c = pcpkv::count_process_resources();
  return {c.open_fds, c.shm_mappings, c.device_mappings};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pcpkv, m) {
  m.class_<BootstrapHolder>("Bootstrap")
      .def(torch::init<int64_t, int64_t, std::string, std::string, std::string, double>())
      .def("rank", [](const c10::intrusive_ptr<BootstrapHolder>& self) -> int64_t { return self->get("rank").rank(); })
      .def("world_size",
           [](const c10::intrusive_ptr<BootstrapHolder>& self) -> int64_t { return self->get("world_size").world_size(); })
      .def("pids",
           [](const c10::intrusive_ptr<BootstrapHolder>& self) -> std::vector<int64_t> { return self->get("pids").pids(); })
      .def("barrier",
           [](const c10::intrusive_ptr<BootstrapHolder>& self) { runtime_errors([&] { self->get("barrier").barrier(); }); })
      // every rank says whether its part of `what` succeeded; raises on every rank naming each failed rank
      .def("agree",
           [](const c10::intrusive_ptr<BootstrapHolder>& self, bool ok, std::string why, std::string what) {
             runtime_errors([&] { self->get("agree").agree(ok, why, what); });
           })
      // every rank's blob in rank order (setup-time descriptions and digests: the ranks compare what they share)
      .def("all_gather",
           [](const c10::intrusive_ptr<BootstrapHolder>& self, std::string blob) -> std::vector<std::string> {
             return runtime_errors([&] {
               std::vector<std::string> out;
               for (const auto& b : self->get("all_gather").all_gather_v(blob.data(), blob.size()))
                 out.emplace_back(b.begin(), b.end());
               return out;
             });
           })
      .def("abort",
           [](const c10::intrusive_ptr<BootstrapHolder>& self, std::string why) {
             if (self->boot) self->boot->abort(why);
           })
      .def("close", [](const c10::intrusive_ptr<BootstrapHolder>& self) { self->boot.reset(); })
      .def("closed", [](const c10::intrusive_ptr<BootstrapHolder>& self) { return self->boot == nullptr; });
}

TORCH_LIBRARY_IMPL(pcpkv, CompositeImplicitAutograd, m) {
  m.impl("make_job_token", &make_job_token);
  m.impl("resource_counts", &resource_counts);
}

}  // namespace pcpkv_torch
