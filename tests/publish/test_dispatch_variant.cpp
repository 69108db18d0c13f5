// pcpkv-test-labels: unit
// PCPKV_DISPATCH_VARIANT (src/publish/contract/dispatch_variant.h): the rule the CUDA launcher applies to kAuto,
// tested on the CPU. An unknown value ("wrap") used to run the default kernel without a word.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "pcpkv/core/error.h"
#include "publish/contract/dispatch_variant.h"
#include "support/error_of.h"

namespace pcpkv::cuda {
namespace {

TEST(DispatchVariantEnv, NamesPickTheirKernelAndUnsetOrEmptyIsTheDefault) {
  EXPECT_EQ(dispatch_variant_from_env(nullptr), std::nullopt);
  EXPECT_EQ(dispatch_variant_from_env(""), std::nullopt);
  EXPECT_EQ(dispatch_variant_from_env("simple"), DispatchVariant::kSimple);
  EXPECT_EQ(dispatch_variant_from_env("prefetch"), DispatchVariant::kPrefetch);
  EXPECT_EQ(dispatch_variant_from_env("warp"), DispatchVariant::kWarp);
  EXPECT_EQ(dispatch_variant_from_env("warp_pf"), DispatchVariant::kWarpPrefetch);
  EXPECT_EQ(dispatch_variant_from_env("warp_token"), DispatchVariant::kWarpToken);
  EXPECT_EQ(dispatch_variant_from_env("warp_split"), DispatchVariant::kWarpSplit);
}

TEST(DispatchVariantEnv, AnUnknownValueIsRefusedNamingVariableValueAndTheAcceptedOnes) {
  for (const char* bad : {"wrap", "WARP", "warp ", "auto", "0", "fastest"}) {
    const std::string e = test::error_of([&] { dispatch_variant_from_env(bad); });
    EXPECT_EQ(e, std::string("PCPKV_DISPATCH_VARIANT: '") + bad +
                     "' is not a dispatch variant; accepted: simple, prefetch, warp, warp_pf, warp_token, warp_split "
                     "(empty or unset: the default)")
        << bad;
  }
  // A huge value is clipped, not quoted whole.
  const std::string huge(100000, 'w');
  const std::string e = test::error_of([&] { dispatch_variant_from_env(huge.c_str()); });
  EXPECT_NE(e.find("PCPKV_DISPATCH_VARIANT: 'www"), std::string::npos) << e;
  EXPECT_LT(e.size(), 1000u);
}

// python/README.md and pcpkv_torch.ops listed "simple|prefetch|warp" while the launcher also takes warp_pf: every
// "PCPKV_DISPATCH_VARIANT=a|b|..." the docs and headers write must list exactly the values the rule accepts.
TEST(DispatchVariantEnv, EveryDocumentedListIsExactlyTheAcceptedValues) {
  std::string accepted;
  for (DispatchVariant v : {DispatchVariant::kAuto, DispatchVariant::kSimple, DispatchVariant::kPrefetch,
                            DispatchVariant::kWarp, DispatchVariant::kWarpPrefetch, DispatchVariant::kWarpToken,
                            DispatchVariant::kWarpSplit}) {
    try {
      dispatch_variant_from_env(to_string(v));
      if (!accepted.empty()) accepted += '|';
      accepted += to_string(v);
    } catch (const Error&) {  // "auto" is refused
    }
  }
  ASSERT_EQ(accepted, "simple|prefetch|warp|warp_pf|warp_token|warp_split");
  namespace fs = std::filesystem;
  const fs::path root(PCPKV_SOURCE_DIR);
  std::vector<fs::path> files = {root / "README.md", root / "python" / "README.md"};
  const std::set<std::string> exts = {".md", ".h", ".cpp", ".cu", ".py"};
  for (const char* dir : {"docs", "include", "src", "python/pcpkv_torch"})
    for (const auto& e : fs::recursive_directory_iterator(root / dir))
      if (e.is_regular_file() && exts.count(e.path().extension().string())) files.push_back(e.path());
  static const std::regex listed(R"(PCPKV_DISPATCH_VARIANT=([a-z_]+(\|[a-z_]+)*))");
  int num_lists = 0;
  for (const fs::path& f : files) {
    std::ifstream in(f);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    for (std::sregex_iterator m(text.begin(), text.end(), listed), end; m != end; ++m, ++num_lists)
      EXPECT_EQ((*m)[1].str(), accepted) << fs::relative(f, root).string();
  }
  EXPECT_GE(num_lists, 4);  // python/README.md, pcpkv_torch/ops.py, docs/perf.md, pcpkv/publish/kernels.h
}

}  // namespace
}  // namespace pcpkv::cuda
