// keep_nccl_nvls_off: see nccl_env.h.
#include "ranks/nccl_env.h"

#include <cstdlib>
#include <string>

#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv::nccl_env {

void keep_nccl_nvls_off() {
  constexpr const char* kName = "NCCL_NVLS_ENABLE";
  const char* v = read_env(kName);
  if (v == nullptr || *v == '\0') {
    PCPKV_CHECK(setenv(kName, "0", 1) == 0, "could not set {}=0 before creating pcpkv's NCCL communicator", kName);
    return;
  }
  PCPKV_CHECK(std::string(v) == "0",
              "{} = '{}': pcpkv never uses NVLink multicast (NVLS); unset it or set it to 0 for pcpkv's NCCL "
              "communicator (collect over NCCL), or use --collect-via p2p, staging or direct",
              kName, clip(v));
}

}  // namespace pcpkv::nccl_env
