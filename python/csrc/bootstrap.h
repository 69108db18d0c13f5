// python/csrc/bootstrap.h: pcpkv's Bootstrap (pcpkv/ranks/bootstrap.h) as a torch custom class,
// torch.classes.pcpkv.Bootstrap, so that Python processes of a torch.distributed group share memory through
// pcpkv's own rendezvous (same-user and job-token checks, bounded waits naming the missing rank).
#pragma once

#include <torch/custom_class.h>

#include <memory>
#include <string>

#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/error.h"

namespace pcpkv_torch {

/// Runs fn; pcpkv::Error (a peer's failure, a refused connection, a timeout) becomes a Python RuntimeError
/// with the same message.
template <class Fn>
auto runtime_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const pcpkv::Error& e) {
    TORCH_CHECK(false, "pcpkv: ", e.what());
  }
}

struct BootstrapHolder : torch::CustomClassHolder {
  std::unique_ptr<pcpkv::Bootstrap> boot;
  /// The rank's side of the rendezvous (see pcpkv::Bootstrap::connect); blocks until every rank is connected.
  BootstrapHolder(int64_t rank, int64_t world_size, std::string address, std::string token, std::string job,
                  double timeout_s);
  /// The bootstrap, or RuntimeError when close() was called.
  pcpkv::Bootstrap& get(const char* what) const;
};

}  // namespace pcpkv_torch
