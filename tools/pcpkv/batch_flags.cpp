// The batch flags (batch_flags.h): one row per flag, the one place its name, field and shared help live.
#include "batch_flags.h"

#include <algorithm>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/layout.h"

#include "list_flags.h"
#include "pcpkv/flag_checks.h"

namespace pcpkv::cli {
namespace {

struct Row {
  BatchFlag flag;
  const char* help;
  CLI::Option* (*add)(CLI::App* sub, BatchFlags& f, const std::string& help);
};

const Row kRows[] = {
    {BatchFlag::kModel, "Model preset: glm-5 | deepseek-v3.2",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--model", f.model, h); }},
    {BatchFlag::kConfig, "HF config.json overriding the preset",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--config", f.config, h); }},
    {BatchFlag::kTokens, "Tokens of the prefill request (0: no prefill)",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--tokens", f.tokens, h); }},
    {BatchFlag::kDecodes, "Decode requests (1 token each)",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--decodes", f.decodes, h); }},
    {BatchFlag::kDecodeContext, "Context length of every decode request",
     [](CLI::App* s, BatchFlags& f, const std::string& h) {
       return s->add_option("--decode-context", f.decode_context, h);
     }},
    {BatchFlag::kBlockSize, "Tokens per cache block (power of two)",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--block-size", f.block_size, h); }},
    {BatchFlag::kLocalOrder, "Order of a rank's rows: request | local (vLLM's: segments starting at position 0 last)",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--local-order", f.local_order, h); }},
    {BatchFlag::kDecodeOwnership,
     "replicated (every rank holds each decode, rank 0 writes it) | round_robin (decode i on rank i % P only)",
     [](CLI::App* s, BatchFlags& f, const std::string& h) {
       return s->add_option("--decode-ownership", f.decode_ownership, h);
     }},
    {BatchFlag::kKvFormat, "MLA cache format: fp8_ds_mla | fp8 | bf16",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--kv-format", f.kv_format, h); }},
    {BatchFlag::kDsMlaScale, "fp8_ds_mla tile scales: pow2 | raw",
     [](CLI::App* s, BatchFlags& f, const std::string& h) {
       return s->add_option("--ds-mla-scale", f.ds_mla_scale, h);
     }},
    {BatchFlag::kKScale, "Per-tensor scale of the static fp8 format",
     [](CLI::App* s, BatchFlags& f, const std::string& h) {
       BatchFlags* p = &f;
       return s->add_option("--k-scale", f.k_scale, h)->each([p](const std::string& typed) { p->k_scale_text = typed; });
     }},
    {BatchFlag::kLayer, "indexer (writes indexer K) | shared (IndexShare layer, no indexer)",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--layer", f.layer, h); }},
    {BatchFlag::kTransport, "all | comma list of collect, staging, direct",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--transport", f.transport, h); }},
    {BatchFlag::kBackend, "auto (CUDA when built and a GPU is visible, else CPU) | cpu | cuda",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--backend", f.backend, h); }},
    {BatchFlag::kThreads, "CPU backend threads (0: all cores)",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--threads", f.threads, h); }},
    {BatchFlag::kSeed, "Seed of the input generator and the block-table shuffle",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--seed", f.seed, h); }},
    {BatchFlag::kRepeats, "Run each publication this many times (timing; results from the last)",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--repeats", f.repeats, h); }},
    {BatchFlag::kTopkWidth, "Fill a top-k buffer [T, width] with -1 (indexer layers; 0: off)",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--topk-width", f.topk_width, h); }},
    {BatchFlag::kTopkFill,
     "Which top-k rows get -1: full (every row, what engines do), tail (only the padding rows past each rank's local "
     "tokens: pcpkv's indexer top-k writes the rest) or none",
     [](CLI::App* s, BatchFlags& f, const std::string& h) { return s->add_option("--topk-fill", f.topk_fill, h); }},
};

}  // namespace

std::vector<Transport> parse_transport_list(const std::string& s) {
  if (s == "all") return {Transport::kCollect, Transport::kStaging, Transport::kDirect};
  std::vector<Transport> out;
  for (const std::string& item : split_commas(s)) {
    PCPKV_CHECK(item == "collect" || item == "staging" || item == "direct",
                "--transport: unknown transport '{}' in '{}'; use all, auto or a comma list of collect, staging, "
                "direct",
                clip(item), clip(s));
    const Transport t = parse_transport(item);
    PCPKV_CHECK(std::find(out.begin(), out.end(), t) == out.end(), "--transport: '{}' is listed twice in '{}'", item,
                clip(s));
    out.push_back(t);
  }
  return out;
}

CacheFormat parse_format_flags(const BatchFlags& f) {
  const std::string k_scale_typed = f.k_scale_text.empty() ? fmt::format("{}", f.k_scale) : f.k_scale_text;
  // Checked as given: 1e-300 would round to 0 and 1e39 to inf, and later checks would name the rounded value.
  if (const auto why = scale_problem(f.k_scale)) PCPKV_FAIL("--k-scale: {}, got {}", *why, clip(k_scale_typed));
  PCPKV_CHECK(f.layer == "indexer" || f.layer == "shared", "--layer: must be indexer or shared, got '{}'", clip(f.layer));
  CacheFormat fmt;
  fmt.kv_format = parse_kv_format(f.kv_format, "kv-format");
  fmt.ds_mla_scale = parse_ds_mla_scale(f.ds_mla_scale, "ds-mla-scale");
  fmt.k_scale = static_cast<float>(f.k_scale);
  fmt.has_indexer = f.layer == "indexer";
  return fmt;
}

void add_batch_flags(CLI::App* sub, BatchFlags& f, std::initializer_list<BatchFlag> flags,
                     std::initializer_list<FlagHelp> help) {
  for (BatchFlag want : flags) {
    for (const Row& row : kRows) {
      if (row.flag != want) continue;
      std::string text = row.help;
      for (const FlagHelp& h : help)
        if (h.flag == want) text = h.help;
      CLI::Option* opt = row.add(sub, f, text);
      if (want != BatchFlag::kConfig) opt->capture_default_str();
    }
  }
}

}  // namespace pcpkv::cli
