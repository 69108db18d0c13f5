// pcpkv-test-labels: unit
// `pcpkv` misuse found by driving the CLI as a new user would (regressions of the fixes): a mistyped
// command, batches too large to exist, out-of-range integers CLI11 would wrap or clamp, empty paths,
// --save targets that are not plain files, a stdout that cannot be written. Every refusal: exit code 2
// (3 for a lost stdout), one "pcpkv: error:" line naming the flag and the value, nothing written, and
// quickly (before any large allocation).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pcpkv/core/error.h"
#include "pcpkv/core/safetensors.h"
#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::InputsFile;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

// `pcpkv <args>` must be refused with exit code 2 within `max_s` seconds, its message holding every
// string of `expect`, stdout empty, and no file but `keep` left in the directory.
void expect_refused(const std::string& args, const std::vector<std::string>& expect, const ScratchDir& dir,
                    const std::vector<std::string>& keep = {}, double max_s = 20.0) {
  const auto start = std::chrono::steady_clock::now();
  const CliResult r = run_cli(args, dir);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  pcpkv_test::expect_refusal(r, args, expect, dir, keep);
  EXPECT_LT(took, max_s) << args << ": a refusal must come before the work";
}

std::string quoted(const std::string& s) { return "'" + s + "'"; }

}  // namespace

// CLI11 said "A subcommand is required" for a typo.
TEST(CliRobustness, UnknownCommandIsNamed) {
  ScratchDir dir;
  expect_refused("bogus", {"unknown command 'bogus'", "run", "info"}, dir);
  expect_refused("rnu --pcp 2", {"unknown command 'rnu'"}, dir);
  const CliResult none = run_cli("", dir);
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.err.find("run"), std::string::npos) << none.err;  // lists the commands
}

// These hung in make_plan (--tokens 99999999999 pushed 1e11 tokens) or ended in "out of memory" with exit
// code 3 and no flag named; the footprint is now checked request by request before the plan exists.
TEST(CliRobustness, BatchTooLargeToExistIsRefusedBeforeAllocating) {
  ScratchDir dir;
  const std::string save = " --save " + quoted(dir.file("out.safetensors"));
  expect_refused("run --tokens 99999999999" + save,
                 {"--tokens 99999999999", "needs about", "of host memory", "available"}, dir);
  expect_refused("run --tokens 16 --pcp 2 --decode-context 999999999999" + save,
                 {"--decode-context 999999999999", "blocks", "int32 block table"}, dir);
  expect_refused("run --tokens 16 --block-size 1073741824" + save, {"--block-size 1073741824", "memory"}, dir);
  expect_refused("run --decodes 2000000000 --decode-context 0" + save, {"--decodes 2000000000", "memory"}, dir);
  expect_refused("run --decodes 2000000000" + save, {"--decodes 2000000000", "counting only the first"}, dir);
  expect_refused("run --pcp 1024 --tokens 99999999" + save, {"--pcp 1024", "cache replicas"}, dir);
}

// An inputs file whose requests describe a context of 2^62 tokens: the plan would overflow its block ids.
TEST(CliRobustness, InputsFileWithAHugeContextIsRefused) {
  ScratchDir dir;
  InputsFile f(pcpkv_test::small_plan_config());
  f.requests[3 * 1 + 2] = int64_t{1} << 62;  // request 1 (the decode): context_len
  f.write(dir.file("in.safetensors"));
  expect_refused(std::string("run ") + pcpkv_test::kSmallRunFlags + " --inputs " + quoted(dir.file("in.safetensors")),
                 {"--inputs", "in.safetensors", "4611686018427387904", "int32 block table"}, dir, {"in.safetensors"});
}

// CLI11 turned --seed -1 into 2^64-1 and clamped 99999999999999999999 to 2^63-1 without a word; the
// message then showed a value the user never typed. --threads 100000 started 100000 threads.
TEST(CliRobustness, OutOfRangeIntegersAreRefused) {
  ScratchDir dir;
  expect_refused("run --seed -1", {"--seed", "-1", "out of range"}, dir);
  expect_refused("run --seed 18446744073709551616", {"--seed", "18446744073709551616"}, dir);
  expect_refused("run --tokens 99999999999999999999", {"--tokens", "99999999999999999999", "out of range"}, dir);
  expect_refused("run --decode-context 9223372036854775808", {"--decode-context", "9223372036854775808"}, dir);
  expect_refused("run --threads 100000", {"--threads", "100000", "1024"}, dir);
  // The largest seed still runs.
  const CliResult ok = run_cli("run --tokens 16 --decodes 1 --pcp 2 --seed 18446744073709551615", dir);
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.out.find("seed 18446744073709551615"), std::string::npos) << ok.out;
}

// `--save "$OUT"` with OUT unset ran and saved nothing, exit 0.
TEST(CliRobustness, EmptyPathsAreRefused) {
  ScratchDir dir;
  expect_refused("run --tokens 16 --pcp 2 --save ''", {"--save", "empty"}, dir);
  expect_refused("run --tokens 16 --pcp 2 --inputs ''", {"--inputs", "empty"}, dir);
  expect_refused("run --tokens 16 --pcp 2 --config ''", {"--config", "empty"}, dir);
}

TEST(CliRobustness, DirectoriesAndPipesAsInputsAreNamed) {
  ScratchDir dir;
  fs::create_directories(dir.file("d"));
  expect_refused("run --inputs " + quoted(dir.file("d")), {"--inputs", "is a directory"}, dir, {"d"});
  // The config loader read a directory as empty JSON ("unexpected end of input").
  expect_refused("run --config " + quoted(dir.file("d")), {"--config", "is a directory"}, dir, {"d"});
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0644), 0);
  expect_refused("run --inputs " + quoted(dir.file("fifo")), {"--inputs", "not a regular file"}, dir, {"d", "fifo"});
}

// --save renamed its file over whatever was there: a FIFO became a regular file (as root, so would
// /dev/null). A directory that cannot take the file was found only after the whole run.
TEST(CliRobustness, SaveRefusesTargetsThatAreNotPlainFiles) {
  ScratchDir dir;
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0644), 0);
  expect_refused("run --tokens 16 --pcp 2 --save " + quoted(dir.file("fifo")), {"--save", "not a regular file"}, dir,
                 {"fifo"});
  EXPECT_TRUE(fs::is_fifo(dir.file("fifo")));
  std::ofstream(dir.file("plain")) << "x";
  expect_refused("run --tokens 16 --pcp 2 --save " + quoted(dir.file("plain") + "/out.safetensors"),
                 {"--save", "is not a directory"}, dir, {"fifo", "plain"});
  if (fs::is_directory("/proc/self")) {
    // Nobody, root included, creates files in /proc: refused up front, not after the run.
    expect_refused("run --save /proc/pcpkv_out.safetensors", {"--save", "/proc/pcpkv_out.safetensors", "cannot create"},
                   dir, {"fifo", "plain"}, 10.0);
  }
}

// Through a symbolic link --save replaces the link's target (even a dangling one) and keeps the link; an
// existing regular file is replaced atomically.
TEST(CliRobustness, SaveThroughASymlinkWritesItsTarget) {
  ScratchDir dir;
  std::ofstream(dir.file("target.safetensors")) << "old";
  fs::create_symlink("target.safetensors", dir.file("link.safetensors"));
  fs::create_symlink("later.safetensors", dir.file("dangling.safetensors"));
  for (const char* name : {"link.safetensors", "dangling.safetensors"}) {
    const CliResult r = run_cli("run --tokens 16 --decodes 1 --pcp 2 --save " + quoted(dir.file(name)), dir);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(fs::is_symlink(dir.file(name))) << name;
  }
  for (const char* name : {"target.safetensors", "later.safetensors"}) {
    const pcpkv::SafetensorsReader reader(dir.file(name));  // a complete file, not "old"
    EXPECT_TRUE(reader.has("mla_cache")) << name;
  }
  std::vector<std::string> files = dir.files();
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"dangling.safetensors", "later.safetensors", "link.safetensors",
                                             "target.safetensors"}));  // no temporary left
}

// The library writer refuses too (callers other than the CLI).
TEST(CliRobustness, SafetensorsWriterRefusesANonRegularTarget) {
  ScratchDir dir;
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0644), 0);
  pcpkv::SafetensorsWriter w;
  const std::vector<int32_t> v = {1, 2, 3};
  w.add("v", pcpkv::StDtype::kI32, {3}, v);
  EXPECT_THROW(w.write(dir.file("fifo")), pcpkv::Error);
  EXPECT_TRUE(fs::is_fifo(dir.file("fifo")));
  fs::create_directories(dir.file("d"));
  EXPECT_THROW(w.write(dir.file("d")), pcpkv::Error);
  EXPECT_EQ(dir.files().size(), 2u);
}

// "slot_mapping[40] = 9 duplicates --inputs x: slot_mapping[3]": the origin is named once.
TEST(CliRobustness, DuplicateSlotMessageNamesTheFileOnce) {
  ScratchDir dir;
  InputsFile f(pcpkv_test::small_plan_config());
  f.slots[40] = f.slots[3];
  f.write(dir.file("in.safetensors"));
  const CliResult r = run_cli(std::string("run ") + pcpkv_test::kSmallRunFlags + " --inputs " +
                                  quoted(dir.file("in.safetensors")),
                              dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("duplicates slot_mapping[3]"), std::string::npos) << r.err;
  const std::string origin = "--inputs " + dir.file("in.safetensors");
  EXPECT_EQ(r.err.find(origin), r.err.rfind(origin)) << r.err;
}

// `pcpkv info > /dev/full` (or a full disk) exited 0 with the report lost.
TEST(CliRobustness, UnwritableStdoutIsAnError) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this system";
  ScratchDir dir;
  for (const std::string args : {"info", "run --tokens 16 --decodes 1 --pcp 2 --json"}) {
    const std::string cmd = quoted(PCPKV_CLI_PATH) + " " + args + " >/dev/full 2>" + quoted(dir.file("err"));
    const int status = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(status)) << args;
    EXPECT_EQ(WEXITSTATUS(status), 3) << args;
    EXPECT_NE(pcpkv_test::slurp(dir.file("err")).find("cannot write the output to stdout"), std::string::npos)
        << args;
  }
}

// `info` printed "configs in <dir>" even where no config was found and built-in values were used.
TEST(CliRobustness, InfoSaysWhenPresetsAreBuiltIn) {
  ScratchDir dir;
  ::setenv("PCPKV_CONFIG_DIR", dir.file("none").c_str(), 1);
  const CliResult r = run_cli("info", dir);
  const CliResult j = run_cli("info --json", dir);
  ::unsetenv("PCPKV_CONFIG_DIR");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("built-in values"), std::string::npos) << r.out;
  const auto doc = nlohmann::json::parse(j.out);
  EXPECT_EQ(doc["presets"][0]["source"], "built-in");
  const CliResult found = run_cli("info --json", dir);
  EXPECT_NE(nlohmann::json::parse(found.out)["presets"][0]["source"].get<std::string>().find(".json"),
            std::string::npos);
}

// --topk-fill on a shared layer, --ds-mla-scale or --k-scale on a format that has no use for them were
// dropped without a word; each is now a note (stdout and JSON), and the run still passes.
TEST(CliRobustness, FlagsThatDoNotApplyAreNoted) {
  ScratchDir dir;
  const std::string base = "run --tokens 16 --decodes 1 --pcp 2 ";
  const CliResult topk = run_cli(base + "--layer shared --topk-fill", dir);
  EXPECT_EQ(topk.exit_code, 0) << topk.err;
  EXPECT_NE(topk.out.find("note: --topk-fill: not used"), std::string::npos) << topk.out;
  const CliResult scale = run_cli(base + "--kv-format fp8 --ds-mla-scale raw", dir);
  EXPECT_EQ(scale.exit_code, 0) << scale.err;
  EXPECT_NE(scale.out.find("note: --ds-mla-scale: not used"), std::string::npos) << scale.out;
  const CliResult k = run_cli(base + "--k-scale 2 --json", dir);
  EXPECT_EQ(k.exit_code, 0) << k.err;
  const auto doc = nlohmann::json::parse(k.out);
  ASSERT_EQ(doc["notes"].size(), 1u) << k.out;
  EXPECT_NE(doc["notes"][0].get<std::string>().find("--k-scale: not used"), std::string::npos);
  // Used flags give no note.
  const CliResult used = run_cli(base + "--kv-format fp8 --k-scale 2 --json", dir);
  EXPECT_TRUE(nlohmann::json::parse(used.out)["notes"].empty()) << used.out;
}

// "1 keys missing", "1 non-finite values".
TEST(CliRobustness, CountsAgreeWithTheirNoun) {
  ScratchDir dir;
  std::string text = pcpkv_test::slurp(std::string(PCPKV_SOURCE_DIR) + "/configs/glm-5.json");
  const std::string key = "\"q_lora_rank\": 2048,";
  ASSERT_NE(text.find(key), std::string::npos);
  text.replace(text.find(key), key.size(), "\"q_lora_rank\": 2048, \"foo\": 1,");
  std::ofstream(dir.file("c.json")) << text;
  const CliResult r = run_cli("run --tokens 16 --decodes 1 --pcp 2 --config " + quoted(dir.file("c.json")), dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("config: 1 key not used by pcpkv: foo"), std::string::npos) << r.out;
}

// scripts/run.sh let apt-get's progress (stdout) into `./scripts/run.sh --json | jq` on a machine that
// missed a package. Hermetic: dpkg-query, apt-get, sudo, cmake and ninja are stand-ins on PATH (apt-get
// prints to stdout like the real one); the script then runs the CLI that ctest built.
TEST(CliRobustness, RunScriptKeepsStdoutForTheReport) {
  ScratchDir dir;
  const std::string shim = dir.file("shim");
  fs::create_directories(shim);
  auto tool = [&](const std::string& name, const std::string& body) {
    std::ofstream(shim + "/" + name) << "#!/bin/sh\n" << body << "\n";
    fs::permissions(shim + "/" + name, fs::perms::owner_all);
  };
  tool("dpkg-query", "exit 1");  // every package missing
  tool("apt-get", "echo \"Reading package lists... (stand-in apt-get $*)\"");
  tool("sudo", "exec \"$@\"");
  tool("cmake", "exit 0");
  tool("ninja", "exit 0");
  const std::string build = fs::path(PCPKV_CLI_PATH).parent_path().string();
  const std::string cmd = "PATH=" + quoted(shim) + ":\"$PATH\" PCPKV_BUILD_DIR=" + quoted(build) + " " +
                          quoted(std::string(PCPKV_SOURCE_DIR) + "/scripts/run.sh") +
                          " --tokens 16 --decodes 1 --pcp 2 --json >" + quoted(dir.file("out")) + " 2>" +
                          quoted(dir.file("err"));
  const int status = std::system(cmd.c_str());
  const std::string err = pcpkv_test::slurp(dir.file("err"));
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << err;
  EXPECT_NE(err.find("stand-in apt-get"), std::string::npos) << err;  // the stand-in did run
  const std::string out = pcpkv_test::slurp(dir.file("out"));
  ASSERT_TRUE(nlohmann::json::accept(out)) << out.substr(0, 300);
  EXPECT_TRUE(nlohmann::json::parse(out)["ok"].get<bool>());
}

// scripts/setup_python.sh given a relative VENV (scripts/test.sh passes <PCPKV_BUILD_DIR>/python-venv, so
// PCPKV_BUILD_DIR=b) wrote `exec "b/python-venv/bin/python"` into pcpkv-python, which then failed (exit 127) from
// any other directory: test.sh runs it from python/. Hermetic: the base interpreter and the venv's python are
// stand-ins, the CUDA toolkit an empty libcublasLt.so.13.
TEST(CliRobustness, PythonSetupWithARelativeVenvWorksFromAnyDirectory) {
  ScratchDir dir;
  fs::create_directories(dir.file("cuda/lib64"));
  std::ofstream(dir.file("cuda/lib64/libcublasLt.so.13")).put('\n');
  std::ofstream(dir.file("python3")) << "#!/bin/sh\n"
                                        "if [ \"$1\" = -m ] && [ \"$2\" = venv ]; then\n"
                                        "  mkdir -p \"$3/bin\" && printf '#!/bin/sh\\necho stand-in venv python\\n' "
                                        "> \"$3/bin/python\" && chmod +x \"$3/bin/python\"\n"
                                        "else echo 3.11.2; fi\n";
  fs::permissions(dir.file("python3"), fs::perms::owner_all);
  const std::string setup = std::string(PCPKV_SOURCE_DIR) + "/scripts/setup_python.sh";
  const std::string cmd = "cd " + quoted(dir.file("")) + " && PCPKV_PYTHON=" + quoted(dir.file("python3")) +
                          " CUDA_HOME=" + quoted(dir.file("cuda")) + " " + quoted(setup) + " venv >out 2>err";
  int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << pcpkv_test::slurp(dir.file("err"));
  const std::string run = "cd / && " + quoted(dir.file("venv/bin/pcpkv-python")) + " >" + quoted(dir.file("out")) +
                          " 2>" + quoted(dir.file("err"));
  status = std::system(run.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << pcpkv_test::slurp(dir.file("err"));
  EXPECT_NE(pcpkv_test::slurp(dir.file("out")).find("stand-in venv python"), std::string::npos);
}
