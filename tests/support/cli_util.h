// Helpers for the CLI tests (test_cli_*.cpp): run the built `pcpkv` binary (PCPKV_CLI_PATH), capture its
// exit code, stdout and stderr; a per-test scratch directory; a valid inputs file to corrupt.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/core/safetensors.h"

namespace pcpkv_test {

namespace fs = std::filesystem;

struct CliResult {
  int exit_code = -1;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// A scratch directory named after the running test, removed afterwards.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    // Short (a hash of the test's name): launch refuses a --socket-dir whose socket path would not fit sun_path.
    const std::string name = std::string(info->test_suite_name()) + "." + info->name();
    path_ = fs::temp_directory_path() /
            fmt::format("pcpkv_cli_{:08x}_{}", static_cast<uint32_t>(std::hash<std::string>{}(name)), ::getpid());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  /// Names of the files in the directory.
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path().filename().string());
    return out;
  }

 private:
  fs::path path_;
};

/// A --json document printed by the CLI; a failed expectation (and an empty object) when it is not JSON.
inline nlohmann::json parse_json(const std::string& s) {
  try {
    return nlohmann::json::parse(s);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not JSON: " << e.what() << "\n" << s;
    return nlohmann::json::object();
  }
}

/// Runs `pcpkv <args>` (args already shell-quoted where needed), stdout and stderr captured to files.
inline CliResult run_cli(const std::string& args, const ScratchDir& dir) {
  const std::string out_path = dir.file(".stdout"), err_path = dir.file(".stderr");
  const std::string cmd = std::string("'") + PCPKV_CLI_PATH + "' " + args + " >'" + out_path + "' 2>'" + err_path + "'";
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  fs::remove(out_path);
  fs::remove(err_path);
  return r;
}

/// The checks every refusal shares: exit code 2; stderr starts with "pcpkv: error: " (error_first; launched
/// ranks prefix their lines, so then it only has to hold it) and holds every string of `expect`; stdout
/// empty; no file left in `dir` but those named in `keep`. `label` says which command in a failure.
inline void expect_refusal(const CliResult& r, const std::string& label, const std::vector<std::string>& expect,
                           const ScratchDir& dir, const std::vector<std::string>& keep = {}, bool error_first = true) {
  EXPECT_EQ(r.exit_code, 2) << label << "\nstderr: " << r.err;
  if (error_first) {
    // The error is the first line, after any progress lines ("pcpkv: [ 2.0 s] ..."): a loaded machine may
    // take the 2 s after which the CLI reports progress before it reaches the failing step.
    size_t first = 0;
    while (r.err.compare(first, 8, "pcpkv: [") == 0 && r.err.find('\n', first) != std::string::npos)
      first = r.err.find('\n', first) + 1;
    EXPECT_EQ(r.err.compare(first, 14, "pcpkv: error: "), 0) << label << "\nstderr: " << r.err;
  } else {
    EXPECT_NE(r.err.find("pcpkv: error: "), std::string::npos) << label << "\nstderr: " << r.err;
  }
  for (const auto& e : expect)
    EXPECT_NE(r.err.find(e), std::string::npos) << label << ": missing '" << e << "' in\n" << r.err;
  EXPECT_TRUE(r.out.empty()) << label << "\nstdout: " << r.out;
  std::vector<std::string> files = dir.files();
  std::erase_if(files, [&](const std::string& f) { return std::find(keep.begin(), keep.end(), f) != keep.end(); });
  EXPECT_TRUE(files.empty()) << label << ": left " << (files.empty() ? "" : files.front());
}

/// The tensors of a valid inputs file for `plan` (glm-5 dims), with requests and slot_mapping, so a test
/// can corrupt one of them before writing.
struct InputsFile {
  pcpkv::ModelConfig model;
  pcpkv::PcpPlan plan;
  pcpkv::GlobalInputs in;
  std::vector<int64_t> requests;  // [R, 3]
  std::vector<int64_t> slots;     // [N]

  explicit InputsFile(const pcpkv::PlanConfig& pc) : model(pcpkv::preset("glm-5")), plan(pcpkv::make_plan(pc)) {
    in = pcpkv::generate_inputs(model, plan, /*has_indexer=*/true, /*seed=*/7);
    for (const auto& r : plan.requests) {
      requests.insert(requests.end(),
                      {r.kind == pcpkv::RequestKind::kPrefill ? 0 : 1, r.num_new_tokens, r.context_len});
    }
    slots = plan.global_slots;
  }

  /// Adds every tensor except those named in `skip` to w (which must not outlive *this).
  void add_to(pcpkv::SafetensorsWriter& w, const std::vector<std::string>& skip = {}) const {
    using pcpkv::StDtype;
    const int64_t n = in.num_tokens;
    auto want = [&](const std::string& name) { return std::find(skip.begin(), skip.end(), name) == skip.end(); };
    if (want("q_c")) w.add("q_c", StDtype::kBF16, {n, in.q_lora_rank}, in.q_c);
    if (want("kv")) w.add("kv", StDtype::kBF16, {n, 512}, in.kv);
    if (want("k_pe")) w.add("k_pe", StDtype::kBF16, {n, 64}, in.k_pe);
    if (want("index_k")) w.add("index_k", StDtype::kBF16, {n, 128}, in.index_k);
    if (want("positions")) w.add("positions", StDtype::kI64, {n}, in.positions);
    if (want("q_norm_w")) w.add("q_norm_w", StDtype::kF32, {in.q_lora_rank}, in.weights.q_norm_w);
    if (want("kv_norm_w")) w.add("kv_norm_w", StDtype::kF32, {512}, in.weights.kv_norm_w);
    if (want("index_ln_w")) w.add("index_ln_w", StDtype::kF32, {128}, in.weights.index_ln_w);
    if (want("index_ln_b")) w.add("index_ln_b", StDtype::kF32, {128}, in.weights.index_ln_b);
    if (want("requests")) w.add("requests", StDtype::kI64, {static_cast<int64_t>(requests.size() / 3), 3}, requests);
    if (want("slot_mapping")) w.add("slot_mapping", StDtype::kI64, {n}, slots);
  }

  void write(const std::string& path, const std::vector<std::string>& skip = {}) const {
    pcpkv::SafetensorsWriter w;
    add_to(w, skip);
    w.write(path);
  }
};

/// The small batch the CLI tests use: one 96-token prefill and one decode (context 100), PCP 2, block 16.
inline pcpkv::PlanConfig small_plan_config() {
  pcpkv::PlanConfig pc;
  pc.pcp_world = 2;
  pc.block_size = 16;
  pc.seed = 0;
  pc.requests = {{pcpkv::RequestKind::kPrefill, 96, 0}, {pcpkv::RequestKind::kDecode, 1, 100}};
  return pc;
}
inline const char* kSmallRunFlags = "--pcp 2 --block-size 16";

}  // namespace pcpkv_test
