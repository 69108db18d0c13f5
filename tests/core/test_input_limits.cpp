// pcpkv-test-labels: unit
// Hostile files: deeply nested JSON, huge values quoted in messages, duplicate tensor names,
// files that are not regular files, a shadowed rope_theta, and a save killed by a signal. Each refusal
// names the file and what is wrong, in a bounded message, and never crashes.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/safetensors.h"
#include "support/cli_util.h"
#include "support/error_of.h"

namespace {

namespace fs = std::filesystem;
using pcpkv_test::ScratchDir;

using pcpkv::test::error_of;

std::string nested(int levels, const std::string& inner = "") {
  return std::string(static_cast<size_t>(levels), '[') + inner + std::string(static_cast<size_t>(levels), ']');
}

// A safetensors file whose JSON header is `header` (no data).
void write_raw_safetensors(const std::string& path, std::string header) {
  while (header.size() % 8) header += ' ';
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>(n >> (8 * i)));
  f << header;
}

TEST(InputLimits, JsonDepthIsBoundedAndStringsDoNotCount) {
  EXPECT_NO_THROW(pcpkv::check_json_depth(nested(64), "x.json"));
  const std::string e = error_of([] { pcpkv::check_json_depth(nested(65), "x.json"); });
  EXPECT_NE(e.find("x.json: the JSON nests 65 levels deep (pcpkv reads at most 64)"), std::string::npos) << e;
  EXPECT_NE(e.find("byte offset 64"), std::string::npos) << e;
  // Brackets inside strings, escaped quotes included, are text.
  EXPECT_NO_THROW(pcpkv::check_json_depth("{\"a\": \"" + std::string(1000, '[') + "\\\"[[[\"}", "x.json"));
}

TEST(InputLimits, ClipBoundsQuotedValues) {
  EXPECT_EQ(pcpkv::clip("short"), "short");
  const std::string c = pcpkv::clip(std::string(100000, 'v'));
  EXPECT_EQ(c, std::string(200, 'v') + "... (100000 characters)");
  const std::string m = pcpkv::clip_middle(std::string(3000, 'a') + "REASON", 100);
  EXPECT_LT(m.size(), 160u);
  EXPECT_NE(m.find("REASON"), std::string::npos) << m;  // the tail, where the reason stands, is kept
  EXPECT_NE(m.find("characters omitted"), std::string::npos) << m;
}

// 100,000 levels crashed the loader (SIGSEGV while the error printed the value).
TEST(InputLimits, DeeplyNestedConfigIsRefusedNamingFileAndDepth) {
  const std::string deep = nested(100000);
  for (const std::string& text :
       {"{\"model_type\": \"glm_moe_dsa\", \"x\": " + deep + "}",
        "{\"model_type\": \"glm_moe_dsa\", \"rope_parameters\": {\"factor\": " + deep + "}}",
        "{\"model_type\": \"glm_moe_dsa\", \"q_lora_rank\": " + nested(2000) + "}", deep}) {
    const std::string e = error_of([&] { pcpkv::parse_hf_config(text, "", nullptr, false, "deep.json"); });
    EXPECT_EQ(e.rfind("deep.json: the JSON nests ", 0), 0u) << e.substr(0, 300);
    EXPECT_NE(e.find("(pcpkv reads at most 64)"), std::string::npos) << e.substr(0, 300);
    EXPECT_LT(e.size(), 300u);
  }
  // Under the limit, a wrong-typed value is quoted, bounded.
  const std::string e = error_of(
      [&] { pcpkv::parse_hf_config("{\"model_type\": \"glm_moe_dsa\", \"q_lora_rank\": " + nested(50) + "}", "",
                                   nullptr, false, "c.json"); });
  EXPECT_NE(e.find("'q_lora_rank' must be an integer"), std::string::npos) << e;
  EXPECT_LT(e.size(), 400u) << e;
}

TEST(InputLimits, HugeValuesInConfigMessagesAreClipped) {
  const std::string big(200000, 'x');
  // A string value is quoted as JSON (200002 characters with its quotes), the model type as text.
  for (const auto& [text, count] : std::vector<std::pair<std::string, std::string>>{
           {"{\"model_type\": \"glm_moe_dsa\", \"q_lora_rank\": \"" + big + "\"}", "(200002 characters)"},
           {"{\"model_type\": \"" + big + "\"}", "(200000 characters)"},
           {"{\"model_type\": \"glm_moe_dsa\", \"indexer_types\": [\"" + big + "\"]}", "(200002 characters)"}}) {
    const std::string e = error_of([&] { pcpkv::parse_hf_config(text, "", nullptr, false, "c.json"); });
    EXPECT_NE(e.find(count), std::string::npos) << e.substr(0, 400);
    EXPECT_LT(e.size(), 700u);
  }
}

TEST(InputLimits, DeeplyNestedSafetensorsHeaderIsRefused) {
  ScratchDir dir;
  const std::string deep = nested(100000);
  const std::vector<std::string> headers = {
      "{\"__metadata__\": {\"a\": " + deep + "}}",
      "{\"t\": {\"dtype\": \"U8\", \"shape\": " + deep + ", \"data_offsets\": [0, 0]}}",
      "{\"t\": " + deep + "}"};
  for (const std::string& h : headers) {
    const std::string path = dir.file("deep.safetensors");
    write_raw_safetensors(path, h);
    const std::string e = error_of([&] { pcpkv::SafetensorsReader r(path); });
    EXPECT_EQ(e.rfind(path + ": the JSON header: the JSON nests 10000", 0), 0u) << e.substr(0, 300);
    EXPECT_NE(e.find("levels deep (pcpkv reads at most 64)"), std::string::npos) << e.substr(0, 300);
    EXPECT_LT(e.size(), 400u);
  }
  // Under the limit, a value of the wrong type is quoted, bounded.
  const std::string path = dir.file("shape.safetensors");
  write_raw_safetensors(path, "{\"t\": {\"dtype\": \"U8\", \"shape\": [" + nested(60, "\"" + std::string(1000, 'x') + "\"") +
                                  "], \"data_offsets\": [0, 0]}}");
  const std::string e = error_of([&] { pcpkv::SafetensorsReader r(path); });
  EXPECT_NE(e.find("shape[0] must be an integer"), std::string::npos) << e.substr(0, 300);
  EXPECT_NE(e.find("characters)"), std::string::npos) << e.substr(0, 300);
  EXPECT_LT(e.size(), 500u);
}

// The last of two equal keys won silently (the other order blamed a gap in the buffer).
TEST(InputLimits, DuplicateTensorNamesAreRefused) {
  ScratchDir dir;
  const std::string path = dir.file("dup.safetensors");
  write_raw_safetensors(path,
                        "{\"kv\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [0, 4]}, "
                        "\"kv\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [4, 4]}}");
  std::ofstream(path, std::ios::app | std::ios::binary) << "abcd";
  std::string e = error_of([&] { pcpkv::SafetensorsReader r(path); });
  EXPECT_NE(e.find("the JSON header names tensor 'kv' twice"), std::string::npos) << e;
  write_raw_safetensors(path, "{\"__metadata__\": {\"a\": \"1\", \"a\": \"2\"}}");
  e = error_of([&] { pcpkv::SafetensorsReader r(path); });
  EXPECT_NE(e.find("names the key 'a' twice"), std::string::npos) << e;
}

TEST(InputLimits, OnlyRegularFilesOfBoundedSizeAreRead) {
  ScratchDir dir;
  fs::create_directories(dir.file("d"));
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  {
    std::ofstream big(dir.file("big.json"));
  }
  fs::resize_file(dir.file("big.json"), pcpkv::kMaxConfigFileBytes + 1);  // sparse
  const int64_t max = pcpkv::kMaxConfigFileBytes;
  EXPECT_NE(error_of([&] { pcpkv::check_input_file("--config", dir.file("d"), max); }).find("is a directory"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pcpkv::read_input_file("--config", dir.file("fifo"), max); })
                .find("is a FIFO (named pipe), not a regular file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pcpkv::read_input_file("--config", "/dev/zero", max); })
                .find("--config: '/dev/zero' is a character device, not a regular file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pcpkv::read_input_file("--config", dir.file("big.json"), max); })
                .find(fmt::format("has {} bytes, more than the {} bytes", max + 1, max)),
            std::string::npos);
  EXPECT_NE(error_of([&] { pcpkv::check_input_file("--inputs", dir.file("none"), 0); }).find("no such file"),
            std::string::npos);
  // The config loader and the safetensors reader use the same rule (the loader hung on a FIFO and read
  // /dev/zero past the memory pre-check).
  EXPECT_NE(error_of([&] { pcpkv::load_hf_config(dir.file("fifo"), "", nullptr, false); }).find("FIFO"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pcpkv::load_hf_config("/dev/zero", "", nullptr, false); }).find("character device"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pcpkv::SafetensorsReader r(dir.file("fifo")); }).find("FIFO"), std::string::npos);
  // A preset file that is a FIFO is refused, naming the preset (it hung `pcpkv info`).
  ASSERT_EQ(::mkfifo(dir.file("glm-5.json").c_str(), 0600), 0);
  ::setenv("PCPKV_CONFIG_DIR", dir.file("").c_str(), 1);
  const std::string e = error_of([] { pcpkv::preset("glm-5"); });
  ::unsetenv("PCPKV_CONFIG_DIR");
  EXPECT_NE(e.find("preset 'glm-5'"), std::string::npos) << e;
  EXPECT_NE(e.find("FIFO"), std::string::npos) << e;
}

// A top-level rope_theta that rope_parameters overrides was dropped without a word.
TEST(InputLimits, ShadowedRopeThetaGetsANote) {
  pcpkv::ConfigNotes notes;
  const auto m = pcpkv::parse_hf_config(
      R"({"model_type": "glm_moe_dsa", "rope_theta": 10000,
          "rope_parameters": {"rope_type": "default", "rope_theta": 50000}})",
      "", &notes, false, "c.json");
  EXPECT_EQ(m.rope.theta, 50000);
  bool found = false;
  for (const auto& r : notes.remarks)
    found = found || r.find("top-level 'rope_theta' = 10000 is shadowed by 'rope_parameters.rope_theta' = 50000: "
                            "using 50000") != std::string::npos;
  EXPECT_TRUE(found) << (notes.remarks.empty() ? "(no remarks)" : notes.remarks.front());
  // The same value twice is no news.
  pcpkv::ConfigNotes same;
  pcpkv::parse_hf_config(R"({"model_type": "glm_moe_dsa", "rope_theta": 50000,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 50000}})",
                         "", &same, false, "c.json");
  for (const auto& r : same.remarks) EXPECT_EQ(r.find("shadowed"), std::string::npos) << r;
}

// A save that receives `sig` while it writes (after installing a handler for it when `handled`): the child's exit
// status, and whether FILE.tmp.<pid> was left and the saved file exists.
struct SignalledSave {
  int status = 0;
  bool temp_left = false;
  bool saved = false;
};

std::atomic<int> g_handled{0};

SignalledSave signal_save_with(int sig, bool handled) {
  ScratchDir dir;
  const std::string target = dir.file("out.safetensors");
  std::fflush(stdout);
  const pid_t child = ::fork();
  if (child == 0) {
    if (handled) ::signal(sig, [](int) { g_handled.fetch_add(1); });
    std::vector<uint8_t> data(size_t{256} << 20, 0x5a);
    pcpkv::SafetensorsWriter w;
    w.add("x", pcpkv::StDtype::kU8, {static_cast<int64_t>(data.size())}, data.data(),
          static_cast<int64_t>(data.size()));
    const std::string tmp = fmt::format("{}.tmp.{}", target, ::getpid());
    std::thread watcher([tmp, target, sig] {
      struct stat st {};
      while (::stat(tmp.c_str(), &st) != 0 && ::stat(target.c_str(), &st) != 0)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      ::kill(::getpid(), sig);  // mid-write: the file exists and is being filled
    });
    bool ok = true;
    try {
      w.write(target);
    } catch (...) {
      ok = false;
    }
    watcher.join();
    // The write finished before the signal arrived: wait for it.
    if (!handled)
      for (int i = 0; i < 500; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ::_exit(ok ? 0 : 1);
  }
  SignalledSave k;
  EXPECT_EQ(::waitpid(child, &k.status, 0), child);
  k.temp_left = fs::exists(fmt::format("{}.tmp.{}", target, child));
  k.saved = fs::exists(target);
  return k;
}

// SIGTERM while --save writes left FILE.tmp.<pid> behind; so did SIGUSR1 and SIGALRM (issue 31), and, after
// those were listed, SIGPWR, SIGIO, SIGSTKFLT, a real-time signal and kill -ABRT (issue 31's break test): every
// signal whose default action ends the process.
TEST(InputLimits, SignalDuringSaveLeavesNoTemporaryFile) {
  for (int sig : {SIGTERM, SIGUSR1, SIGALRM, SIGHUP, SIGPWR, SIGIO, SIGSTKFLT, SIGRTMIN, SIGRTMAX, SIGABRT, SIGSYS}) {
    SCOPED_TRACE(fmt::format("signal {}", sig));  // sigabbrev_np has no name for a real-time signal
    const SignalledSave k = signal_save_with(sig, false);
    ASSERT_TRUE(WIFSIGNALED(k.status)) << "the child was not killed by the signal";
    EXPECT_EQ(WTERMSIG(k.status), sig);
    EXPECT_FALSE(k.temp_left) << "the temporary file was left behind";
  }
}

// A signal the program handles does not end it: the save must not lose its temporary file to the cleanup (a
// handler that returns, such as a timer's, left the write to fail at the rename).
TEST(InputLimits, HandledSignalDuringSaveKeepsTheSave) {
  const SignalledSave k = signal_save_with(SIGUSR1, true);
  ASSERT_TRUE(WIFEXITED(k.status));
  EXPECT_EQ(WEXITSTATUS(k.status), 0) << "the save failed";
  EXPECT_TRUE(k.saved);
  EXPECT_FALSE(k.temp_left);
}

}  // namespace
