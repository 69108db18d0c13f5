// python/csrc/transport.cpp: torch.ops.pcpkv.choose_transport (schema: registry.cpp; docstring:
// pcpkv_torch/transport.py), host-only.
#include <ATen/Functions.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checks.h"
#include "pcpkv/publish/transport_choice.h"

namespace pcpkv_torch {
namespace {

// transport "auto" (pcpkv::choose_transport): the decision stays in one C++ function for the CLI and Python.
std::tuple<std::string, std::string> choose_transport(std::vector<std::string> hosts, const at::Tensor& peer_access,
                                                      bool nccl_available) {
  const auto P = static_cast<int64_t>(hosts.size());
  TORCH_CHECK_VALUE(peer_access.dim() == 2 && peer_access.size(0) == P && peer_access.size(1) == P,
                    "choose_transport: peer_access must be [", P, ", ", P, "] (one row per host entry), got ",
                    describe(peer_access));
  const at::Tensor a = peer_access.to(at::kCPU).to(at::kBool).contiguous();
  pcpkv::Topology t;
  t.hosts = std::move(hosts);
  t.nccl_available = nccl_available;
  const bool* p = a.data_ptr<bool>();
  for (int64_t r = 0; r < P; ++r) t.peer_access.emplace_back(p + r * P, p + (r + 1) * P);
  const pcpkv::TransportChoice c = translate_errors([&] { return pcpkv::choose_transport(t); });
  return {pcpkv::to_string(c.transport), c.reason};
}

}  // namespace

TORCH_LIBRARY_IMPL(pcpkv, CompositeImplicitAutograd, m) { m.impl("choose_transport", &choose_transport); }

}  // namespace pcpkv_torch
