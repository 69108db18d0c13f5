// pcpkv-test-labels: unit
// The registry of the PCPKV_* environment variables (pcpkv/core/env.h): every name a source reads is in it
// (checked on the sources themselves), read_env refuses an unregistered PCPKV_* name, and `pcpkv info`
// lists the registry as text and JSON.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "support/cli_util.h"

namespace fs = std::filesystem;
using pcpkv::env_registry;
using pcpkv::EnvVar;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;

namespace {

struct Hit {
  std::string file, name;
  bool getenv;  // std::getenv("PCPKV_..."), which only src/core/env.cpp may call
};

// Every complete "PCPKV_..." string literal of the library's and the CLI's sources: the names passed to
// getenv / read_env and the kEnv* constants of pcpkv/ranks/bootstrap.h.
std::vector<Hit> literals_in_sources() {
  static const std::regex literal(R"re((getenv\s*\(\s*)?"(PCPKV_[A-Z0-9_]+)")re");
  std::vector<Hit> hits;
  for (const char* top : {"src", "tools", "include"}) {
    for (const auto& entry : fs::recursive_directory_iterator(fs::path(PCPKV_SOURCE_DIR) / top)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".cu" && ext != ".cuh")) continue;
      std::ifstream in(entry.path());
      std::stringstream ss;
      ss << in.rdbuf();
      const std::string text = ss.str();
      for (std::sregex_iterator m(text.begin(), text.end(), literal), end; m != end; ++m)
        hits.push_back({fs::relative(entry.path(), PCPKV_SOURCE_DIR).string(), (*m)[2].str(), (*m)[1].matched});
    }
  }
  return hits;
}

}  // namespace

TEST(EnvRegistry, EntriesAreUniqueSortedAndDocumented) {
  const std::vector<EnvVar>& reg = env_registry();
  ASSERT_GE(reg.size(), 10u);
  std::set<std::string> names;
  for (size_t i = 0; i < reg.size(); ++i) {
    const std::string name = reg[i].name;
    EXPECT_EQ(name.rfind("PCPKV_", 0), 0u) << name;
    EXPECT_TRUE(names.insert(name).second) << "registered twice: " << name;
    if (i > 0) {
      EXPECT_LT(std::string(reg[i - 1].name), name) << "not sorted";
    }
    EXPECT_GT(std::string(reg[i].meaning).size(), 10u) << name;
    EXPECT_FALSE(std::string(reg[i].default_value).empty()) << name;
    EXPECT_FALSE(std::string(reg[i].reader).empty()) << name;
    EXPECT_EQ(pcpkv::find_env_var(name), &reg[i]);
  }
  EXPECT_EQ(pcpkv::find_env_var("PCPKV_NOT_A_VARIABLE"), nullptr);
}

// The grep: a PCPKV_* name in src/, tools/ or include/ that is not registered fails here, and only the
// registry's accessor calls std::getenv with a PCPKV_* name.
TEST(EnvRegistry, EveryNameTheSourcesReadIsRegistered) {
  const std::vector<Hit> hits = literals_in_sources();
  std::set<std::string> seen;
  for (const Hit& h : hits) {
    seen.insert(h.name);
    EXPECT_NE(pcpkv::find_env_var(h.name), nullptr) << h.file << " names " << h.name
                                                    << ", which is not in the registry (src/core/env.cpp)";
    if (h.file != "src/core/env.cpp") {
      EXPECT_FALSE(h.getenv) << h.file << " calls getenv(\"" << h.name << "\"): use pcpkv::read_env";
    }
  }
  // The scan itself works: the readers known today are found outside the registry's own file.
  for (const char* known : {"PCPKV_CONFIG_DIR", "PCPKV_DEVICE", "PCPKV_DISPATCH_VARIANT", "PCPKV_PDL", "PCPKV_DEBUG",
                            "PCPKV_RANK", "PCPKV_BOOTSTRAP_DIR"}) {
    bool outside = false;
    for (const Hit& h : hits) outside = outside || (h.name == known && h.file != "src/core/env.cpp");
    EXPECT_TRUE(outside) << known << " not found in the sources: the scan is broken";
  }
  // And every registered name is still read somewhere (a stale entry would mislead `pcpkv info`).
  for (const EnvVar& v : env_registry()) {
    bool outside = false;
    for (const Hit& h : hits) outside = outside || (h.name == v.name && h.file != "src/core/env.cpp");
    EXPECT_TRUE(outside) << v.name << " is registered but no source outside src/core/env.cpp names it";
  }
}

TEST(EnvRegistry, ReadEnvReadsRegisteredNamesAndRefusesOthers) {
  ::setenv("PCPKV_DEVICE", "3", 1);
  const char* v = pcpkv::read_env("PCPKV_DEVICE");
  ASSERT_NE(v, nullptr);
  EXPECT_STREQ(v, "3");
  ::setenv("PCPKV_DEVICE", "", 1);
  v = pcpkv::read_env("PCPKV_DEVICE");
  ASSERT_NE(v, nullptr) << "an empty value is returned as is";
  EXPECT_STREQ(v, "");
  ::unsetenv("PCPKV_DEVICE");
  EXPECT_EQ(pcpkv::read_env("PCPKV_DEVICE"), nullptr);
  ::setenv("PCPKV_NOT_A_VARIABLE", "1", 1);
  try {
    pcpkv::read_env("PCPKV_NOT_A_VARIABLE");
    ADD_FAILURE() << "an unregistered PCPKV_ name was read";
  } catch (const pcpkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("PCPKV_NOT_A_VARIABLE is not in the registry"), std::string::npos) << e.what();
  }
  ::unsetenv("PCPKV_NOT_A_VARIABLE");
  ::setenv("RANK_OF_NOTHING", "7", 1);  // names outside PCPKV_ pass through
  v = pcpkv::read_env("RANK_OF_NOTHING");
  ASSERT_NE(v, nullptr);
  EXPECT_STREQ(v, "7");
  ::unsetenv("RANK_OF_NOTHING");
}

// The one rule of the on/off switches (read_env_switch): "1" on; unset, empty or "0" off; any other value refused,
// naming the variable and the value. PCPKV_PDL took every value but "1" for off, silently (its reader,
// src/core/cuda/pdl_switch.cpp, is tested in tests/serving/test_pdl.cpp).
TEST(EnvRegistry, SwitchesTakeOneZeroOrEmptyAndRefuseAnythingElse) {
  for (const char* name : {"PCPKV_PDL", "PCPKV_CHECK_REPLICAS", "PCPKV_ALLOW_NONLOCAL_MASTER"}) {
    SCOPED_TRACE(name);
    const pcpkv::EnvVar* var = pcpkv::find_env_var(name);
    ASSERT_NE(var, nullptr);
    EXPECT_NE(std::string(var->meaning).find("any other value is refused"), std::string::npos) << var->meaning;
    ::unsetenv(name);
    EXPECT_FALSE(pcpkv::read_env_switch(name));
    ::setenv(name, "1", 1);
    EXPECT_TRUE(pcpkv::read_env_switch(name));
    for (const char* off : {"0", ""}) {
      ::setenv(name, off, 1);
      EXPECT_FALSE(pcpkv::read_env_switch(name)) << "'" << off << "'";
    }
    for (const char* odd : {"yes", "true", "on", "2", " 1", "1 ", "01"}) {
      ::setenv(name, odd, 1);
      try {
        (void)pcpkv::read_env_switch(name);
        ADD_FAILURE() << "'" << odd << "' was accepted";
      } catch (const pcpkv::Error& e) {
        EXPECT_NE(std::string(e.what()).find(std::string(name) + ": must be 1 (on) or 0 / empty / unset (off), got '" +
                                             odd + "'"),
                  std::string::npos)
            << e.what();
      }
    }
    ::unsetenv(name);
  }
}

TEST(EnvRegistry, InfoListsEveryVariable) {
  ScratchDir dir;
  ::setenv("PCPKV_DISPATCH_VARIANT", "simple", 1);
  const auto r = run_cli("info", dir);
  const auto j = run_cli("info --json", dir);
  ::unsetenv("PCPKV_DISPATCH_VARIANT");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(j.exit_code, 0) << j.err;
  EXPECT_NE(r.out.find("environment variables"), std::string::npos) << r.out;
  const nlohmann::json doc = nlohmann::json::parse(j.out);
  ASSERT_EQ(doc["environment"].size(), env_registry().size()) << j.out;
  for (size_t i = 0; i < env_registry().size(); ++i) {
    const EnvVar& v = env_registry()[i];
    EXPECT_NE(r.out.find(v.name), std::string::npos) << v.name;
    EXPECT_NE(r.out.find(v.meaning), std::string::npos) << v.name;
    const auto& e = doc["environment"][i];
    EXPECT_EQ(e["name"], v.name);
    EXPECT_EQ(e["meaning"], v.meaning);
    EXPECT_EQ(e["default"], v.default_value);
    EXPECT_EQ(e["reader"], v.reader);
    // What the CLI saw: this process's environment (inherited), plus the one variable set above.
    const bool set = std::string(v.name) == "PCPKV_DISPATCH_VARIANT" || std::getenv(v.name) != nullptr;
    EXPECT_EQ(e["set"].get<bool>(), set) << v.name;
  }
  EXPECT_NE(r.out.find("PCPKV_DISPATCH_VARIANT"), std::string::npos);
  EXPECT_NE(r.out.find("(set here)"), std::string::npos) << r.out;
}
