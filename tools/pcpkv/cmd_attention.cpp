// `pcpkv attention`: the consumers of the replicated cache end to end (issue 6, SPEC section 6).
// Publishes a mixed prefill + decode batch with PCP P and with one rank, serves every rank's local
// tokens with the indexer and sparse MLA attention on its own replica, and checks the gathered outputs
// against the one-rank run byte for byte (and against the CPU reference, and DCP shards + LSE merge
// within the stated bound). --bench times the CUDA consumers for one layer.
// Exit code: 0 every check passed, 1 a check failed, 2 bad input.
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "pcpkv/attention_check.h"
#include "pcpkv/backend.h"
#include "pcpkv/commands.h"
#include "pcpkv/error.h"
#include "pcpkv/model.h"

// The CLI sees PCPKV_HAVE_CUDA only when the build exports it; PCPKV_HAVE_NCCL (public on pcpkv_cuda)
// also proves the CUDA library is linked.
#if defined(PCPKV_HAVE_CUDA) || defined(PCPKV_HAVE_NCCL)
#define PCPKV_CLI_CUDA 1
#else
#define PCPKV_CLI_CUDA 0
#endif

namespace pcpkv::cli {
namespace {

struct AttentionOptions {
  std::string model = "glm-5";
  std::string pcp = "1,2,4,8";        // PCP worlds to check, each against one rank
  std::string prefill = "301,77";     // prefill lengths
  int64_t prefill_context = 0;        // context of every prefill request (chunked prefill)
  int32_t decodes = 5;
  int64_t decode_context = 3000;      // > top-k: decodes select 2048 of their keys
  int32_t block_size = 64;
  std::string kv_format = "fp8_ds_mla";
  std::string ds_mla_scale = "pow2";
  double k_scale = 1.0 / 64.0;
  std::string transport = "direct";
  std::string backend = "cpu";        // publication backend
  std::string consumers = "cpu";      // cpu | cuda
  std::string attention_kernel = "mma";  // cuda consumers: mma | simt
  std::string bench_indexers = "exact,fp32_tree";
  std::string bench_attentions = "mma,simt";
  int32_t topk = 2048;
  int32_t dcp = 4;
  int32_t dcp_interleave = 1;
  uint64_t seed = 1;
  bool no_reference = false;
  bool bench = false;
  int64_t bench_tokens = 32768;
  int32_t repeats = 3;
};

std::vector<int64_t> parse_list(const std::string& s, const char* flag) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    try {
      size_t used = 0;
      v.push_back(std::stoll(item, &used));
      PCPKV_CHECK(used == item.size(), "{}: '{}' is not an integer", flag, item);
    } catch (const std::logic_error&) {
      PCPKV_FAIL("{}: '{}' is not an integer", flag, item);
    }
  }
  return v;
}

std::vector<std::string> split_names(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) v.push_back(item);
  return v;
}

SparseMlaKernel parse_attention_kernel(const std::string& name, const char* flag) {
  if (name == "mma") return SparseMlaKernel::kMma;
  if (name == "simt") return SparseMlaKernel::kSimt;
  PCPKV_FAIL("{}: unknown attention kernel '{}'; known: mma, simt", flag, name);
}

IndexerLogit parse_indexer_logit(const std::string& name, const char* flag) {
  if (name == "exact") return IndexerLogit::kExact;
  if (name == "fp32_tree") return IndexerLogit::kFp32Tree;
  PCPKV_FAIL("{}: unknown indexer kernel '{}'; known: exact, fp32_tree", flag, name);
}

std::unique_ptr<ConsumerKernels> make_consumers_named(const std::string& name, const std::string& attention_kernel) {
  const SparseMlaKernel kernel = parse_attention_kernel(attention_kernel, "--attention-kernel");
  (void)kernel;  // used by the CUDA consumers only
  if (name == "cpu") return make_cpu_consumers();
  if (name == "cuda") {
#if PCPKV_CLI_CUDA
    return cuda::make_consumers(0, kernel);
#else
    PCPKV_FAIL("--consumers cuda: this pcpkv was built without the CUDA consumers");
#endif
  }
  PCPKV_FAIL("--consumers: unknown '{}'; known: cpu, cuda", name);
}

int run_bench(const AttentionOptions& o) {
#if PCPKV_CLI_CUDA
  const ModelConfig model = preset(o.model);
  ConsumerBenchConfig cfg;
  cfg.num_tokens = o.bench_tokens;
  cfg.kv_format = parse_kv_format(o.kv_format);
  cfg.topk = o.topk;
  cfg.repeats = o.repeats;
  cfg.seed = o.seed;
  cfg.indexers.clear();
  for (const std::string& n : split_names(o.bench_indexers)) cfg.indexers.push_back(parse_indexer_logit(n, "--bench-indexers"));
  cfg.attentions.clear();
  for (const std::string& n : split_names(o.bench_attentions))
    cfg.attentions.push_back(parse_attention_kernel(n, "--bench-attentions"));
  const ConsumerBenchResult r = cuda::bench_consumers(cfg, model);
  fmt::print("pcpkv attention --bench: {} one layer, {} tokens (one causal prefill), top-k {}, {}\n\n", model.name,
             cfg.num_tokens, cfg.topk, o.kv_format);
  std::fputs(r.describe().c_str(), stdout);
  return 0;
#else
  (void)o;
  PCPKV_FAIL("--bench: needs the CUDA consumers; this pcpkv was built without them");
#endif
}

int run_checks(const AttentionOptions& o) {
  const ModelConfig model = preset(o.model);
  AttentionCheckConfig cfg;
  cfg.plan.block_size = o.block_size;
  cfg.plan.seed = o.seed;
  for (int64_t len : parse_list(o.prefill, "--prefill")) {
    PCPKV_CHECK(len >= 1, "--prefill: lengths must be >= 1, got {}", len);
    cfg.plan.requests.push_back({RequestKind::kPrefill, len, o.prefill_context});
  }
  PCPKV_CHECK(o.decodes >= 0, "--decodes must be >= 0, got {}", o.decodes);
  PCPKV_CHECK(o.decodes == 0 || o.decode_context >= 1, "--decode-context must be >= 1, got {}", o.decode_context);
  for (int32_t i = 0; i < o.decodes; ++i)
    cfg.plan.requests.push_back({RequestKind::kDecode, 1, o.decode_context + 13 * i});
  PCPKV_CHECK(!cfg.plan.requests.empty(), "the batch is empty: give --prefill lengths or --decodes");
  cfg.fmt.kv_format = parse_kv_format(o.kv_format);
  cfg.fmt.ds_mla_scale = parse_ds_mla_scale(o.ds_mla_scale);
  cfg.fmt.k_scale = static_cast<float>(o.k_scale);
  cfg.fmt.has_indexer = true;
  cfg.transport = parse_transport(o.transport);
  cfg.topk = o.topk;
  cfg.dcp_world = o.dcp;
  cfg.dcp_interleave = o.dcp_interleave;
  cfg.seed = o.seed;
  cfg.check_reference = !o.no_reference;
  const std::vector<int64_t> worlds = parse_list(o.pcp, "--pcp");
  PCPKV_CHECK(!worlds.empty(), "--pcp: give at least one world size");
  auto publisher = make_backend(o.backend);
  auto consumers = make_consumers_named(o.consumers, o.attention_kernel);
  fmt::print("pcpkv attention: {} ({} q heads, {} index heads, softmax scale {:.6f}), {}, transport {}, "
             "publisher {}, consumers {}{}, top-k {}\n",
             model.name, model.num_attention_heads, model.index_n_heads, model.softmax_scale(), o.kv_format,
             o.transport, publisher->device(), consumers->name(),
             o.consumers == "cuda" ? " (attention " + o.attention_kernel + ")" : std::string(), o.topk);
  bool ok = true;
  for (size_t i = 0; i < worlds.size(); ++i) {
    PCPKV_CHECK(worlds[i] >= 1 && worlds[i] <= 64, "--pcp: world sizes must be in [1, 64], got {}", worlds[i]);
    cfg.plan.pcp_world = static_cast<int32_t>(worlds[i]);
    // The reference and DCP checks do not depend on P: run them once.
    AttentionCheckConfig c = cfg;
    if (i > 0) {
      c.check_reference = false;
      c.dcp_world = 1;
    }
    const AttentionCheckReport rep = run_attention_check(c, model, *publisher, *consumers);
    std::fputs(rep.describe().c_str(), stdout);
    ok = ok && rep.passed();
  }
  std::fflush(stdout);
  return ok ? 0 : 1;
}

}  // namespace

void add_attention_command(CLI::App& app) {
  auto o = std::make_shared<AttentionOptions>();
  CLI::App* sub = app.add_subcommand(
      "attention", "Serve the published replicas with the indexer + sparse MLA attention; check PCP == one rank, "
                   "the CPU reference and DCP + LSE merge (--bench: time the CUDA consumers)");
  sub->add_option("--model", o->model, "Model preset: glm-5 | deepseek-v3.2")->capture_default_str();
  sub->add_option("--pcp", o->pcp, "Comma list of PCP world sizes, each checked against one rank")
      ->capture_default_str();
  sub->add_option("--prefill", o->prefill, "Comma list of prefill lengths")->capture_default_str();
  sub->add_option("--prefill-context", o->prefill_context, "Context already cached for every prefill (chunked prefill)")
      ->capture_default_str();
  sub->add_option("--decodes", o->decodes, "Decode requests (1 token each)")->capture_default_str();
  sub->add_option("--decode-context", o->decode_context, "Context of decode i: this + 13*i")->capture_default_str();
  sub->add_option("--block-size", o->block_size, "Tokens per cache block (power of two)")->capture_default_str();
  sub->add_option("--kv-format", o->kv_format, "MLA cache format: fp8_ds_mla | fp8 | bf16")->capture_default_str();
  sub->add_option("--ds-mla-scale", o->ds_mla_scale, "fp8_ds_mla tile scales: pow2 | raw")->capture_default_str();
  sub->add_option("--k-scale", o->k_scale, "Per-tensor scale of the static fp8 format")->capture_default_str();
  sub->add_option("--transport", o->transport, "Publication transport: collect | staging | direct")
      ->capture_default_str();
  sub->add_option("--backend", o->backend, "Publication backend: auto | cpu | cuda")->capture_default_str();
  sub->add_option("--consumers", o->consumers, "Consumer kernels: cpu | cuda")->capture_default_str();
  sub->add_option("--attention-kernel", o->attention_kernel,
                  "CUDA consumers' attention kernel: mma (bf16 tensor cores) | simt (fp32 CUDA cores)")
      ->capture_default_str();
  sub->add_option("--bench-indexers", o->bench_indexers, "--bench: indexer kernels to time: exact,fp32_tree")
      ->capture_default_str();
  sub->add_option("--bench-attentions", o->bench_attentions, "--bench: attention kernels to time: mma,simt")
      ->capture_default_str();
  sub->add_option("--topk", o->topk, "Indexer top-k (index_topk)")->capture_default_str();
  sub->add_option("--dcp", o->dcp, "DCP shards of the one-rank cache for the LSE-merge check (1: off)")
      ->capture_default_str();
  sub->add_option("--dcp-interleave", o->dcp_interleave, "DCP: positions per shard group")->capture_default_str();
  sub->add_option("--seed", o->seed, "Seed of inputs, queries, context rows and block tables")->capture_default_str();
  sub->add_flag("--no-reference", o->no_reference, "Skip the CPU reference comparison (large batches)");
  sub->add_flag("--bench", o->bench, "Time the CUDA indexer and attention for one layer instead of checking");
  sub->add_option("--tokens", o->bench_tokens, "--bench: tokens of the causal prefill")->capture_default_str();
  sub->add_option("--repeats", o->repeats, "--bench: timed runs (median)")->capture_default_str();
  sub->callback([o] {
    const int code = o->bench ? run_bench(*o) : run_checks(*o);
    if (code != 0) throw CLI::RuntimeError("", code);
  });
}

}  // namespace pcpkv::cli
