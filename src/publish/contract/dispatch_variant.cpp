// Names of the dispatch kernel variants (pcpkv/publish/kernels.h) and the PCPKV_DISPATCH_VARIANT rule
// (dispatch_variant.h). CUDA-free: in pcpkv_core, so the CPU build tests them too.
#include "publish/contract/dispatch_variant.h"

#include <string>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv::cuda {

const char* to_string(DispatchVariant v) {
  switch (v) {
    case DispatchVariant::kAuto: return "auto";
    case DispatchVariant::kSimple: return "simple";
    case DispatchVariant::kPrefetch: return "prefetch";
    case DispatchVariant::kWarp: return "warp";
    case DispatchVariant::kWarpPrefetch: return "warp_pf";
    case DispatchVariant::kWarpToken: return "warp_token";
    case DispatchVariant::kWarpSplit: return "warp_split";
  }
  return "?";
}

DispatchVariant parse_dispatch_variant(const std::string& s) {
  for (DispatchVariant v : {DispatchVariant::kAuto, DispatchVariant::kSimple, DispatchVariant::kPrefetch,
                            DispatchVariant::kWarp, DispatchVariant::kWarpPrefetch, DispatchVariant::kWarpToken,
                            DispatchVariant::kWarpSplit})
    if (s == to_string(v)) return v;
  PCPKV_FAIL("dispatch variant '{}' is not auto, simple, prefetch, warp, warp_pf, warp_token or warp_split", clip(s));
}

std::optional<DispatchVariant> dispatch_variant_from_env(const char* value) {
  if (value == nullptr || *value == '\0') return std::nullopt;
  // Not "auto": the variable exists to pick a kernel for kAuto; unset or empty is the way to get the default.
  for (DispatchVariant v : {DispatchVariant::kSimple, DispatchVariant::kPrefetch, DispatchVariant::kWarp,
                            DispatchVariant::kWarpPrefetch, DispatchVariant::kWarpToken, DispatchVariant::kWarpSplit})
    if (std::string(value) == to_string(v)) return v;
  PCPKV_FAIL("{}: '{}' is not a dispatch variant; accepted: simple, prefetch, warp, warp_pf, warp_token, warp_split "
             "(empty or unset: the default)",
             kEnvDispatchVariant, clip(value));
}

}  // namespace pcpkv::cuda
