// `pcpkv attention`: the consumers of the replicated cache end to end (issue 6, SPEC section 6).
// Publishes a mixed prefill + decode batch with PCP P and with one rank, serves every rank's local
// tokens with the indexer and sparse MLA attention on its own replica, and checks the gathered outputs
// against the one-rank run byte for byte (and against the CPU reference, and DCP shards + LSE merge
// within the stated bound). --bench times the CUDA consumers for one layer.
// Exit code: 0 every check passed, 1 a check failed, 2 bad input.
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "pcpkv/attention_check.h"
#include "pcpkv/backend.h"
#include "pcpkv/commands.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/error.h"
#include "pcpkv/layout.h"
#include "pcpkv/model.h"
#include "pcpkv/plan.h"

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

// "2,4,8" -> {"2", "4", "8"}. An empty entry ("2,,3", "2,", ",2") is refused, not dropped: a dropped entry
// would quietly check fewer cases than asked. An empty list is refused unless allow_empty.
std::vector<std::string> split_list(const std::string& s, const char* flag, bool allow_empty = false) {
  std::vector<std::string> v;
  if (s.empty()) {
    PCPKV_CHECK(allow_empty, "{}: the list is empty", flag);
    return v;
  }
  size_t pos = 0;
  while (true) {
    const size_t comma = s.find(',', pos);
    v.push_back(s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    PCPKV_CHECK(!v.back().empty(), "{}: '{}' has an empty entry", flag, s);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return v;
}

// Comma list of integers in [lo, hi]; the message names the flag, the entry and the whole value.
std::vector<int64_t> parse_int_list(const std::string& s, const char* flag, int64_t lo, int64_t hi,
                                    bool allow_empty = false) {
  std::vector<int64_t> v;
  for (const std::string& item : split_list(s, flag, allow_empty)) {
    int64_t x = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), x);
    PCPKV_CHECK(ec == std::errc() && end == item.data() + item.size(), "{}: '{}' is not an integer (in '{}')", flag,
                item, s);
    if (hi == std::numeric_limits<int64_t>::max()) {
      PCPKV_CHECK(x >= lo, "{}: {} must be >= {} (in '{}')", flag, x, lo, s);
    } else {
      PCPKV_CHECK(x >= lo && x <= hi, "{}: {} is not in [{}, {}] (in '{}')", flag, x, lo, hi, s);
    }
    v.push_back(x);
  }
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

// The flags, parsed and checked: what the check and the bench run from.
struct CheckedOptions {
  AttentionCheckConfig cfg;          // plan.pcp_world unset (one per entry of worlds)
  std::vector<int64_t> worlds;       // --pcp
  ConsumerBenchConfig bench;         // --bench
  SparseMlaKernel attention_kernel = SparseMlaKernel::kMma;
};

// Every flag, before anything is built or printed: a bad one is refused naming the flag and its value
// (the library's own checks would name internal fields, e.g. "dcp_world", and come after the header line).
CheckedOptions check_flags(const AttentionOptions& o) {
  CheckedOptions c;
  (void)preset(o.model);  // "--model: unknown model ..."
  PCPKV_CHECK(o.topk >= 1 && o.topk <= 8192, "--topk: must be in [1, 8192], got {}", o.topk);
  PCPKV_CHECK(o.dcp >= 1 && o.dcp <= 64, "--dcp: must be in [1, 64] (1: off), got {}", o.dcp);
  PCPKV_CHECK(o.dcp_interleave >= 1, "--dcp-interleave: must be >= 1, got {}", o.dcp_interleave);
  PCPKV_CHECK(std::isfinite(o.k_scale) && o.k_scale > 0, "--k-scale: must be positive and finite, got {}", o.k_scale);
  // A value below the smallest float would round to 0 and be refused later under the internal name.
  PCPKV_CHECK(static_cast<float>(o.k_scale) > 0 && std::isfinite(static_cast<float>(o.k_scale)),
              "--k-scale: {} does not fit a float (the cache stores it as fp32)", o.k_scale);
  check_block_size_flag(o.block_size);
  c.cfg.fmt.kv_format = parse_kv_format(o.kv_format, "kv-format");
  c.cfg.fmt.ds_mla_scale = parse_ds_mla_scale(o.ds_mla_scale, "ds-mla-scale");
  c.cfg.fmt.k_scale = static_cast<float>(o.k_scale);
  c.cfg.fmt.has_indexer = true;
  c.cfg.transport = parse_transport(o.transport);  // "--transport: unknown transport ..."
  PCPKV_CHECK(o.backend == "auto" || o.backend == "cpu" || o.backend == "cuda",
              "--backend: unknown backend '{}'; known: auto, cpu, cuda", o.backend);
  PCPKV_CHECK(o.consumers == "cpu" || o.consumers == "cuda", "--consumers: unknown '{}'; known: cpu, cuda",
              o.consumers);
  c.attention_kernel = parse_attention_kernel(o.attention_kernel, "--attention-kernel");
  c.bench.indexers.clear();  // the config's defaults: replaced by the flags'
  c.bench.attentions.clear();
  for (const std::string& n : split_list(o.bench_indexers, "--bench-indexers"))
    c.bench.indexers.push_back(parse_indexer_logit(n, "--bench-indexers"));
  for (const std::string& n : split_list(o.bench_attentions, "--bench-attentions"))
    c.bench.attentions.push_back(parse_attention_kernel(n, "--bench-attentions"));
  PCPKV_CHECK(o.bench_tokens >= 1 && o.bench_tokens < (int64_t{1} << 31), "--tokens: must be in [1, 2^31), got {}",
              o.bench_tokens);
  PCPKV_CHECK(o.repeats >= 1, "--repeats: must be >= 1, got {}", o.repeats);

  c.worlds = parse_int_list(o.pcp, "--pcp", 1, 64);
  for (int64_t len : parse_int_list(o.prefill, "--prefill", 1, std::numeric_limits<int64_t>::max(), true))
    c.cfg.plan.requests.push_back({RequestKind::kPrefill, len, o.prefill_context});
  PCPKV_CHECK(o.prefill_context >= 0, "--prefill-context: must be >= 0, got {}", o.prefill_context);
  PCPKV_CHECK(o.decodes >= 0, "--decodes: must be >= 0, got {}", o.decodes);
  PCPKV_CHECK(o.decodes == 0 || o.decode_context >= 1, "--decode-context: must be >= 1, got {}", o.decode_context);
  for (int32_t i = 0; i < o.decodes; ++i)
    c.cfg.plan.requests.push_back({RequestKind::kDecode, 1, o.decode_context + 13 * int64_t{i}});
  c.cfg.plan.block_size = o.block_size;
  c.cfg.plan.seed = o.seed;
  c.cfg.topk = o.topk;
  c.cfg.dcp_world = o.dcp;
  c.cfg.dcp_interleave = o.dcp_interleave;
  c.cfg.seed = o.seed;
  c.cfg.check_reference = !o.no_reference;

  c.bench.num_tokens = o.bench_tokens;
  c.bench.kv_format = c.cfg.fmt.kv_format;
  c.bench.topk = o.topk;
  c.bench.repeats = o.repeats;
  c.bench.seed = o.seed;
  if (!o.bench) {
    PCPKV_CHECK(!c.cfg.plan.requests.empty(), "the batch is empty: give --prefill lengths or --decodes");
    // Plans are cheap: build each now, so a batch that cannot be planned is refused before the header.
    for (int64_t w : c.worlds) {
      PlanConfig pc = c.cfg.plan;
      pc.pcp_world = static_cast<int32_t>(w);
      (void)make_plan(pc);
    }
  }
  return c;
}

std::unique_ptr<ConsumerKernels> make_consumers_named(const std::string& name, SparseMlaKernel kernel) {
  (void)kernel;  // used by the CUDA consumers only
  if (name == "cpu") return make_cpu_consumers();
#if PCPKV_CLI_CUDA
  return cuda::make_consumers(0, kernel);
#else
  PCPKV_FAIL("--consumers cuda: this pcpkv was built without the CUDA consumers");
#endif
}

int run_bench(const AttentionOptions& o, const CheckedOptions& c) {
#if PCPKV_CLI_CUDA
  const ModelConfig model = preset(o.model);
  const ConsumerBenchResult r = cuda::bench_consumers(c.bench, model);
  fmt::print("pcpkv attention --bench: {} one layer, {} tokens (one causal prefill), top-k {}, {}\n\n", model.name,
             c.bench.num_tokens, c.bench.topk, o.kv_format);
  std::fputs(r.describe().c_str(), stdout);
  return 0;
#else
  (void)o;
  (void)c;
  PCPKV_FAIL("--bench: needs the CUDA consumers; this pcpkv was built without them");
#endif
}

int run_checks(const AttentionOptions& o, const CheckedOptions& c) {
  const ModelConfig model = preset(o.model);
  auto publisher = make_backend(o.backend);
  auto consumers = make_consumers_named(o.consumers, c.attention_kernel);
  fmt::print("pcpkv attention: {} ({} q heads, {} index heads, softmax scale {:.6f}), {}, transport {}, "
             "publisher {}, consumers {}{}, top-k {}\n",
             model.name, model.num_attention_heads, model.index_n_heads, model.softmax_scale(), o.kv_format,
             o.transport, publisher->device(), consumers->name(),
             o.consumers == "cuda" ? " (attention " + o.attention_kernel + ")" : std::string(), o.topk);
  bool ok = true;
  for (size_t i = 0; i < c.worlds.size(); ++i) {
    AttentionCheckConfig cfg = c.cfg;
    cfg.plan.pcp_world = static_cast<int32_t>(c.worlds[i]);
    // The reference and DCP checks do not depend on P: run them once.
    if (i > 0) {
      cfg.check_reference = false;
      cfg.dcp_world = 1;
    }
    const AttentionCheckReport rep = run_attention_check(cfg, model, *publisher, *consumers);
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
  sub->add_option("--prefill", o->prefill, "Comma list of prefill lengths (empty: none)")->capture_default_str();
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
    const CheckedOptions c = check_flags(*o);  // throws pcpkv::Error (exit code 2) before anything is printed
    const int code = o->bench ? run_bench(*o, c) : run_checks(*o, c);
    if (code != 0) throw CLI::RuntimeError("", code);
  });
}

}  // namespace pcpkv::cli
