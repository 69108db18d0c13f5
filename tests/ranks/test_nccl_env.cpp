// pcpkv-test-labels: unit
// keep_nccl_nvls_off (src/ranks/nccl_env.h): pcpkv's NCCL communicator never gets NVLink multicast.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "pcpkv/core/error.h"
#include "ranks/nccl_env.h"

namespace {

constexpr const char* kVar = "NCCL_NVLS_ENABLE";

/// Restores the variable as it was when the test started.
class NcclEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* v = std::getenv(kVar);
    had_ = v != nullptr;
    if (had_) saved_ = v;
  }
  void TearDown() override {
    if (had_) setenv(kVar, saved_.c_str(), 1);
    else unsetenv(kVar);
  }

 private:
  bool had_ = false;
  std::string saved_;
};

std::string value() {
  const char* v = std::getenv(kVar);
  return v == nullptr ? "<unset>" : v;
}

TEST_F(NcclEnvTest, UnsetOrEmptyBecomesZero) {
  unsetenv(kVar);
  pcpkv::nccl_env::keep_nccl_nvls_off();
  EXPECT_EQ(value(), "0");
  setenv(kVar, "", 1);
  pcpkv::nccl_env::keep_nccl_nvls_off();
  EXPECT_EQ(value(), "0");
}

TEST_F(NcclEnvTest, ZeroIsKept) {
  setenv(kVar, "0", 1);
  pcpkv::nccl_env::keep_nccl_nvls_off();
  EXPECT_EQ(value(), "0");
}

TEST_F(NcclEnvTest, AnyOtherValueIsRefusedNamingItAndLeftAlone) {
  for (const char* bad : {"1", "2", "true", " 0", "00"}) {
    setenv(kVar, bad, 1);
    try {
      pcpkv::nccl_env::keep_nccl_nvls_off();
      ADD_FAILURE() << "accepted NCCL_NVLS_ENABLE='" << bad << "'";
    } catch (const pcpkv::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::string("NCCL_NVLS_ENABLE = '") + bad + "'"), std::string::npos) << what;
      EXPECT_NE(what.find("never uses NVLink multicast"), std::string::npos) << what;
    }
    EXPECT_EQ(value(), bad);  // nothing changed
  }
}

TEST_F(NcclEnvTest, AHugeValueIsQuotedClipped) {
  const std::string huge(5000, '1');
  setenv(kVar, huge.c_str(), 1);
  try {
    pcpkv::nccl_env::keep_nccl_nvls_off();
    ADD_FAILURE() << "accepted a huge value";
  } catch (const pcpkv::Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 600u);
  }
}

}  // namespace
