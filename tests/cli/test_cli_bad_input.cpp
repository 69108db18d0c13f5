// pcpkv-test-labels: unit
// `pcpkv run` with bad input: exit code 2, a message "pcpkv: error: ..." naming the field
// and the value, and nothing written (the --save file does not appear, no temporary is left).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "pcpkv/device/codec.h"
#include "pcpkv/core/safetensors.h"
#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::InputsFile;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

// Runs `pcpkv run <args> --save <dir>/out.safetensors` and checks the refusal: exit 2, one error line
// containing every string of `expect`, and no file written into the directory except `inputs`.
void expect_refused(const std::string& args, const std::vector<std::string>& expect, const ScratchDir& dir,
                    const std::vector<std::string>& inputs = {}) {
  const std::string save = dir.file("out.safetensors");
  pcpkv_test::expect_refusal(run_cli("run " + args + " --save '" + save + "'", dir), args, expect, dir, inputs);
}

}  // namespace

TEST(CliBadInput, UnknownModel) {
  ScratchDir dir;
  expect_refused("--model llama-3", {"--model", "'llama-3'", "glm-5", "deepseek-v3.2"}, dir);
}

TEST(CliBadInput, EmptyNumberIsRefusedNamingTheFlag) {
  // CLI11 read '' as 0: `--tokens ''` (an unset shell variable) published an empty prefill and passed,
  // `--memory-limit-gb ''` dropped the limit. Every numeric flag of every command refuses it.
  ScratchDir dir;
  for (const char* flag : {"--tokens", "--seed", "--decodes", "--threads", "--memory-limit-gb", "--decode-context"})
    expect_refused(fmt::format("--pcp 2 --tokens 16 {} ''", flag),
                   {fmt::format("{}: an empty value is not a number, got ''", flag)}, dir);
  for (const std::string cmd : {"bench --replica-check-pcp ''", "attention --pcp 2 --tokens ''",
                                "launch --nproc ''  -- mp-publish --backend cpu"})
    pcpkv_test::expect_refusal(run_cli(cmd, dir), cmd, {"an empty value is not a number, got ''"}, dir);
}

TEST(CliBadInput, MemoryLimitMustBeFinite) {
  // inf was refused as "must be >= 0 ... got inf", which it is.
  ScratchDir dir;
  for (const char* v : {"inf", "nan", "-1"})
    expect_refused(fmt::format("--pcp 2 --tokens 16 --memory-limit-gb {}", v),
                   {"--memory-limit-gb: must be a finite number >= 0", fmt::format("got {}", v)}, dir);
}

TEST(CliBadInput, ControlCharactersOfAValueAreEscaped) {
  // A newline or a terminal escape sequence in a quoted value reached stderr raw: the error is one line.
  ScratchDir dir;
  const CliResult r = run_cli("run --model 'llama\n\x1b[2J'", dir);  // sh keeps both inside single quotes
  pcpkv_test::expect_refusal(r, "model", {"--model: unknown model 'llama\\n\\x1b[2J'"}, dir);
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << r.err;
}

// A binary --config's parse error quoted its byte raw ("last read: '\xff'" reached the terminal as 0xff): bytes
// that are not UTF-8 text and the C1 controls are written as \xNN too; other UTF-8 passes as it is.
TEST(CliBadInput, BytesThatAreNotTextAreEscaped) {
  ScratchDir dir;
  std::ofstream(dir.file("bin.json"), std::ios::binary) << "\xff\xfe{}";
  CliResult r = run_cli("run --config '" + dir.file("bin.json") + "'", dir);
  pcpkv_test::expect_refusal(r, "binary config", {"bin.json: not valid JSON", "last read: '\\xff'"}, dir,
                             {"bin.json"});
  EXPECT_EQ(r.err.find('\xff'), std::string::npos) << r.err;
  // A lone continuation byte, a cut-short sequence, an overlong '/', a surrogate and U+009B (CSI) are escaped;
  // 'ä' and '€' are text.
  r = run_cli("run --model 'a\x80 b\xe2\x82 c\xc0\xaf d\xed\xa0\x80 e\xc2\x9b[2J \xc3\xa4\xe2\x82\xac'", dir);
  pcpkv_test::expect_refusal(r, "model",
                             {"unknown model 'a\\x80 b\\xe2\\x82 c\\xc0\\xaf d\\xed\\xa0\\x80 e\\xc2\\x9b[2J "
                              "\xc3\xa4\xe2\x82\xac'"},
                             dir, {"bin.json"});
}

TEST(CliBadInput, PcpBelowOne) {
  ScratchDir dir;
  expect_refused("--pcp 0", {"--pcp", "0"}, dir);
  expect_refused("--pcp=-3", {"--pcp", "-3"}, dir);
  expect_refused("--pcp eight", {"--pcp", "eight"}, dir);
}

TEST(CliBadInput, PositionsPastTheModel) {
  // DeepSeek-V3.2 has max_position_embeddings 163840: the prefill's token 163840 is past it, refused before
  // any input is generated; so is a decode whose context is the whole range.
  ScratchDir dir;
  expect_refused("--tokens 200000 --model deepseek-v3.2",
                 {"--tokens 200000 --decodes 4 (model deepseek-v3.2)", "request 0 (prefill of 200000 tokens",
                  "reaches position 163840", "max_position_embeddings is 163840"},
                 dir);
  expect_refused("--tokens 0 --decodes 1 --decode-context 202752 --pcp 1",
                 {"request 0 (decode at position 202752)", "max_position_embeddings is 202752", "glm-5"}, dir);
}

TEST(CliBadInput, BlockSizeNotPowerOfTwo) {
  ScratchDir dir;
  expect_refused("--block-size 48", {"--block-size", "power of two", "48"}, dir);
  expect_refused("--block-size 0", {"--block-size", "0"}, dir);
  // An indexer block of B slots is B * 132 bytes and must stay 16-byte aligned.
  expect_refused("--block-size 2", {"--block-size", "2", "multiple of 16"}, dir);
}

TEST(CliBadInput, BadEnumsAndCounts) {
  ScratchDir dir;
  expect_refused("--kv-format fp4", {"kv-format", "fp4"}, dir);
  expect_refused("--ds-mla-scale e8m0", {"ds-mla-scale", "e8m0"}, dir);
  expect_refused("--layer dense", {"--layer", "dense"}, dir);
  expect_refused("--transport collect,nvls", {"--transport", "nvls"}, dir);
  expect_refused("--transport direct,direct", {"--transport", "twice"}, dir);
  expect_refused("--backend tpu", {"--backend", "tpu"}, dir);
  expect_refused("--tokens=-5", {"--tokens", "-5"}, dir);
  expect_refused("--tokens 0 --decodes 0", {"empty"}, dir);
  expect_refused("--repeats 0", {"--repeats", "0"}, dir);
  // Unbounded, --repeats 2000000000 ran for days before printing anything.
  expect_refused("--repeats 2000000000", {"--repeats", "must be in [1, 1000000]", "2000000000"}, dir);
  expect_refused("--no-such-flag", {"--no-such-flag"}, dir);
}

TEST(CliBadInput, SaveIntoMissingDirectory) {
  ScratchDir dir;
  const std::string save = dir.file("missing/out.safetensors");
  const CliResult r = run_cli("run --tokens 64 --decodes 0 --pcp 2 --save '" + save + "'", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--save"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
  EXPECT_TRUE(dir.files().empty());
}

TEST(CliBadInput, BadConfigField) {
  ScratchDir dir;
  const std::string base = pcpkv_test::slurp(std::string(PCPKV_SOURCE_DIR) + "/configs/glm-5.json");
  ASSERT_FALSE(base.empty());
  struct Case {
    std::string from, to;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"\"q_lora_rank\": 2048", "\"q_lora_rank\": \"big\"", {"q_lora_rank", "big"}},
      {"\"q_lora_rank\": 2048", "\"q_lora_rank\": 2050", {"q_lora_rank", "2050"}},
      {"\"kv_lora_rank\": 512", "\"kv_lora_rank\": 256", {"kv_lora_rank", "256"}},
      {"\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": -1", {"rms_norm_eps", "-1"}},
      {"\"model_type\": \"glm_moe_dsa\"", "\"model_type\": \"llama\"", {"model_type", "llama"}},
      // nlohmann kept the last of two equal keys: this loaded q_lora_rank 1024 without a word.
      {"\"q_lora_rank\": 2048", "\"q_lora_rank\": 2048, \"q_lora_rank\": 1024",
       {"config.json: the key 'q_lora_rank' appears twice in one object"}},
  };
  for (const Case& c : cases) {
    std::string text = base;
    const size_t at = text.find(c.from);
    ASSERT_NE(at, std::string::npos) << c.from;
    text.replace(at, c.from.size(), c.to);
    const std::string path = dir.file("config.json");
    std::ofstream(path) << text;
    expect_refused("--tokens 64 --decodes 0 --pcp 2 --config '" + path + "'", c.expect, dir, {"config.json"});
  }
  std::ofstream(dir.file("config.json")) << "{ not json";
  expect_refused("--config '" + dir.file("config.json") + "'", {"config.json"}, dir, {"config.json"});
  expect_refused("--config '" + dir.file("nope.json") + "'", {"--config", "nope.json"}, dir, {"config.json"});
}

TEST(CliBadInput, SlotOutOfRange) {
  ScratchDir dir;
  InputsFile f(pcpkv_test::small_plan_config());
  const int64_t num_slots = f.plan.num_slots();
  f.slots[17] = num_slots + 5;
  f.write(dir.file("in.safetensors"));
  expect_refused(std::string(pcpkv_test::kSmallRunFlags) + " --inputs '" + dir.file("in.safetensors") + "'",
                 {"slot_mapping[17]", std::to_string(num_slots + 5), "out of range", std::to_string(num_slots)}, dir,
                 {"in.safetensors"});
}

TEST(CliBadInput, SlotDuplicated) {
  ScratchDir dir;
  InputsFile f(pcpkv_test::small_plan_config());
  f.slots[40] = f.slots[3];
  f.write(dir.file("in.safetensors"));
  expect_refused(std::string(pcpkv_test::kSmallRunFlags) + " --inputs '" + dir.file("in.safetensors") + "'",
                 {"slot_mapping[40]", std::to_string(f.slots[3]), "duplicates", "slot_mapping[3]"}, dir,
                 {"in.safetensors"});
}

TEST(CliBadInput, SlotInNullBlockOrNegative) {
  ScratchDir dir;
  InputsFile f(pcpkv_test::small_plan_config());
  f.slots[5] = 3;  // block 0 is the null block
  f.write(dir.file("in.safetensors"));
  const std::string args = std::string(pcpkv_test::kSmallRunFlags) + " --inputs '" + dir.file("in.safetensors") + "'";
  expect_refused(args, {"slot_mapping[5]", "= 3", "null block"}, dir, {"in.safetensors"});
  f.slots[5] = -1;
  f.write(dir.file("in.safetensors"));
  expect_refused(args, {"slot_mapping[5]", "-1"}, dir, {"in.safetensors"});
}

TEST(CliBadInput, TensorOfWrongShapeOrDtype) {
  ScratchDir dir;
  InputsFile f(pcpkv_test::small_plan_config());
  const int64_t n = f.in.num_tokens;
  const std::string path = dir.file("in.safetensors");
  const std::string args = std::string(pcpkv_test::kSmallRunFlags) + " --inputs '" + path + "'";
  {  // kv with 511 columns
    pcpkv::SafetensorsWriter w;
    f.add_to(w, {"kv"});
    std::vector<uint16_t> kv(static_cast<size_t>(n * 511), 0x3f80);
    w.add("kv", pcpkv::StDtype::kBF16, {n, 511}, kv);
    w.write(path);
    expect_refused(args, {"tensor 'kv'", fmt::format("expected BF16 [{}, 512], got BF16 [{}, 511]", n, n)}, dir,
                   {"in.safetensors"});
  }
  {  // k_pe stored as F32
    pcpkv::SafetensorsWriter w;
    f.add_to(w, {"k_pe"});
    std::vector<float> k_pe(static_cast<size_t>(n * 64), 1.0f);
    w.add("k_pe", pcpkv::StDtype::kF32, {n, 64}, k_pe);
    w.write(path);
    expect_refused(args, {"tensor 'k_pe'", fmt::format("expected BF16 [{}, 64], got F32 [{}, 64]", n, n)}, dir,
                   {"in.safetensors"});
  }
  {  // positions as I32
    pcpkv::SafetensorsWriter w;
    f.add_to(w, {"positions"});
    std::vector<int32_t> pos(static_cast<size_t>(n), 0);
    w.add("positions", pcpkv::StDtype::kI32, {n}, pos);
    w.write(path);
    expect_refused(args, {"tensor 'positions'", "expected I64", "got I32"}, dir, {"in.safetensors"});
  }
  {  // index_k missing on an indexer layer
    f.write(path, {"index_k"});
    expect_refused(args, {"'index_k'", "missing"}, dir, {"in.safetensors"});
  }
  {  // a position that disagrees with the requests
    InputsFile g(pcpkv_test::small_plan_config());
    g.in.positions[10] = 999;
    g.write(path);
    expect_refused(args, {"positions[10] = 999"}, dir, {"in.safetensors"});
  }
  {  // requests that do not add up to the rows
    InputsFile g(pcpkv_test::small_plan_config());
    g.requests[1] = 90;
    g.write(path);
    expect_refused(args, {"'requests'", "adds up to 91", "97 rows"}, dir, {"in.safetensors"});
  }
}

TEST(CliBadInput, TruncatedSafetensors) {
  ScratchDir dir;
  InputsFile f(pcpkv_test::small_plan_config());
  const std::string path = dir.file("in.safetensors");
  f.write(path);
  const auto size = fs::file_size(path);
  fs::resize_file(path, size - 100);
  expect_refused(std::string(pcpkv_test::kSmallRunFlags) + " --inputs '" + path + "'",
                 {"in.safetensors", "truncated", "offset", "tensor '"}, dir, {"in.safetensors"});
  expect_refused("--inputs '" + dir.file("absent.safetensors") + "'", {"--inputs", "absent.safetensors"}, dir,
                 {"in.safetensors"});
}

TEST(CliBadInput, NonFiniteActivationsAreRefusedUnlessAllowed) {
  ScratchDir dir;
  InputsFile f(pcpkv_test::small_plan_config());
  const uint16_t nan = 0x7fc0, inf = 0x7f80;
  f.in.kv[5 * 512 + 3] = nan;
  f.in.kv[9 * 512 + 100] = inf;
  f.in.index_k[2 * 128 + 1] = nan;
  const std::string path = dir.file("in.safetensors");
  f.write(path);
  const std::string args = std::string(pcpkv_test::kSmallRunFlags) + " --inputs '" + path + "'";
  expect_refused(args, {"3 non-finite", "kv", "index_k", "--allow-nonfinite"}, dir, {"in.safetensors"});

  // Allowed: it runs; the verdict may fail (NaN has no FP8 bound) but it is not refused as bad input.
  const CliResult r = run_cli("run " + args + " --allow-nonfinite --transport direct", dir);
  EXPECT_NE(r.exit_code, 2) << r.err;
  EXPECT_NE(r.out.find("non-finite"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("verdict:"), std::string::npos) << r.out;
}

// CLI11 reads integers with strtoll base 0: --tokens 064 published 52 tokens (octal), --pcp 0x8 ran PCP 8, and
// a leading space passed while a trailing one did not. Integers are plain decimal now; a sign stays allowed.
TEST(CliBadInput, IntegersArePlainDecimal) {
  ScratchDir dir;
  expect_refused("--tokens 064", {"--tokens", "'064' has a leading zero", "octal"}, dir);
  expect_refused("--pcp 010", {"--pcp", "'010' has a leading zero"}, dir);
  expect_refused("--pcp 0x2", {"--pcp", "'0x2' is not a decimal integer"}, dir);
  expect_refused("--tokens 1e3", {"--tokens", "'1e3' is not a decimal integer"}, dir);
  expect_refused("--tokens ' 64'", {"--tokens", "' 64' is not a decimal integer"}, dir);
  expect_refused("--tokens '64 '", {"--tokens", "'64 ' is not a decimal integer"}, dir);
  expect_refused("--seed 00", {"--seed", "'00' has a leading zero"}, dir);
  const CliResult ok = run_cli(std::string("run --backend cpu --transport direct ") + pcpkv_test::kSmallRunFlags +
                                   " --tokens +96 --seed 0",
                               dir);
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// CLI11 quotes a value whole and lists every unexpected argument: a 3000-digit --seed gave a 3 KB line and
// 200 unknown flags were all listed. The README's bounds: 200 characters of a value, 20 names.
TEST(CliBadInput, ParseErrorsKeepTheReadmeBounds) {
  ScratchDir dir;
  const std::string digits(3000, '9');
  CliResult r = run_cli("run --seed " + digits, dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--seed: " + digits.substr(0, 200) + "... (3000 characters) is out of range"),
            std::string::npos)
      << r.err;
  EXPECT_LT(r.err.size(), 500u) << r.err;
  std::string flags;
  for (int i = 0; i < 200; ++i) flags += fmt::format(" --nosuch{}", i);
  r = run_cli("run" + flags, dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("were not expected: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(" and 180 more"), std::string::npos) << r.err;
  EXPECT_LT(r.err.size(), 600u) << r.err;
  r = run_cli("run --tokens " + digits, dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_LT(r.err.size(), 500u) << r.err;
  // A value pcpkv already clipped is not clipped again ("... (204 characters) (3000 characters)").
  r = run_cli("run --threads " + std::string(3000, 'x'), dir);
  EXPECT_NE(r.err.find(std::string(200, 'x') + "... (3000 characters)' is not a decimal integer"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("(204 characters)"), std::string::npos) << r.err;
  // The first 20 in the order given (CLI11 lists the last first).
  std::string numbers;
  for (int i = 1; i <= 30; ++i) numbers += fmt::format(" {}", i);
  r = run_cli("run" + numbers, dir);
  EXPECT_NE(r.err.find("were not expected: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and 10 more"),
            std::string::npos)
      << r.err;
}
