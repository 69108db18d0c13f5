// PCPKV_DISPATCH_VARIANT (src/publish/dispatch_variant.h): the rule the CUDA launcher applies to kAuto, tested on
// the CPU. An unknown value ("wrap") used to run the default kernel without a word.
#include <gtest/gtest.h>

#include <string>

#include "pcpkv/core/error.h"
#include "publish/dispatch_variant.h"
#include "support/error_of.h"

namespace pcpkv::cuda_detail {
namespace {

TEST(DispatchVariantEnv, NamesPickTheirKernelAndUnsetOrEmptyIsTheDefault) {
  EXPECT_EQ(dispatch_variant_from_env(nullptr), std::nullopt);
  EXPECT_EQ(dispatch_variant_from_env(""), std::nullopt);
  EXPECT_EQ(dispatch_variant_from_env("simple"), DispatchVariant::kSimple);
  EXPECT_EQ(dispatch_variant_from_env("prefetch"), DispatchVariant::kPrefetch);
  EXPECT_EQ(dispatch_variant_from_env("warp"), DispatchVariant::kWarp);
  EXPECT_EQ(dispatch_variant_from_env("warp_pf"), DispatchVariant::kWarpPrefetch);
}

TEST(DispatchVariantEnv, AnUnknownValueIsRefusedNamingVariableValueAndTheAcceptedOnes) {
  for (const char* bad : {"wrap", "WARP", "warp ", "auto", "0", "fastest"}) {
    const std::string e = test::error_of([&] { dispatch_variant_from_env(bad); });
    EXPECT_EQ(e, std::string("PCPKV_DISPATCH_VARIANT: '") + bad +
                     "' is not a dispatch variant; accepted: simple, prefetch, warp, warp_pf (empty or unset: the "
                     "default)")
        << bad;
  }
  // A huge value is clipped, not quoted whole.
  const std::string huge(100000, 'w');
  const std::string e = test::error_of([&] { dispatch_variant_from_env(huge.c_str()); });
  EXPECT_NE(e.find("PCPKV_DISPATCH_VARIANT: 'www"), std::string::npos) << e;
  EXPECT_LT(e.size(), 1000u);
}

}  // namespace
}  // namespace pcpkv::cuda_detail
