// pcpkv-test-labels: unit
// Issue 31 item 10: a --save, --inputs or --config path of 300 characters was quoted whole, though the README
// promises that a message quotes at most 200 characters of any value (then "... (N characters)").
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

// `args` is refused (exit 2) with every path cut to 200 characters: no run of 201 of the path's filler characters.
void expect_path_clipped(const std::string& args, const std::string& flag, const ScratchDir& dir) {
  const CliResult r = run_cli(args, dir);
  EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
  EXPECT_NE(r.err.find("pcpkv: error: " + flag), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(" characters)"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(std::string(201, 'p')), std::string::npos) << "a path quoted whole: " << r.err;
}

TEST(CliLongPaths, MissingFilesAreQuotedCut) {
  ScratchDir dir;
  const std::string missing = dir.file(std::string(150, 'p') + "/" + std::string(150, 'p'));
  expect_path_clipped("run --backend cpu --save '" + missing + "/out.safetensors'", "--save", dir);
  expect_path_clipped("run --backend cpu --inputs '" + missing + "'", "--inputs", dir);
  expect_path_clipped("run --backend cpu --config '" + missing + "'", "--config", dir);
}

TEST(CliLongPaths, BadFilesAreQuotedCut) {
  ScratchDir dir;
  const std::string deep = dir.file(std::string(150, 'p') + "/" + std::string(150, 'p'));
  fs::create_directories(deep);
  { std::ofstream(deep + "/config.json") << "{\"model_type\": "; }
  { std::ofstream(deep + "/inputs.safetensors") << "not a safetensors file"; }
  expect_path_clipped("run --backend cpu --config '" + deep + "/config.json'", "", dir);  // "<path>: not valid JSON"
  expect_path_clipped("run --backend cpu --inputs '" + deep + "/inputs.safetensors'", "", dir);  // "<path>: ..."
  expect_path_clipped("run --backend cpu --save '" + deep + "'", "--save", dir);  // a directory
}

}  // namespace
