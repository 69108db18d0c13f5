// src/publish/contract/dispatch_variant.h: PCPKV_DISPATCH_VARIANT, parsed without CUDA (pcpkv_core) so the CPU build
// tests the rule; the CUDA launcher (src/publish/kernels/cuda/dispatch.cu) applies it to DispatchVariant::kAuto.
#pragma once

#include <optional>

#include "pcpkv/publish/kernels.h"

namespace pcpkv::cuda {

constexpr const char* kEnvDispatchVariant = "PCPKV_DISPATCH_VARIANT";

/// The variant a PCPKV_DISPATCH_VARIANT value names: "simple" | "prefetch" | "warp" | "warp_pf"; nullopt for
/// nullptr (unset) or "" (kAuto then runs the launcher's default). Any other value ("wrap", "auto", "WARP") throws
/// pcpkv::Error naming the variable, the value (clipped) and the accepted values: a typo must not run the default
/// silently, and a benchmark must not measure another kernel than the one it names.
std::optional<DispatchVariant> dispatch_variant_from_env(const char* value);

}  // namespace pcpkv::cuda
