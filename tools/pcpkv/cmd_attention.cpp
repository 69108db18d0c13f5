// `pcpkv attention`: the consumers of the replicated cache end to end (SPEC section 6).
// Publishes a mixed prefill + decode batch with PCP P and with one rank, serves every rank's local
// tokens with the indexer and sparse MLA attention on its own replica, and checks the gathered outputs
// against the one-rank run byte for byte (and against the CPU reference, and DCP shards + LSE merge
// within the stated bound). --bench times the CUDA consumers for one layer.
// Exit code: 0 every check passed, 1 a check failed, 2 bad input.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "batch_flags.h"
#include "error_line.h"
#include "footprint.h"
#include "list_flags.h"
#include "pcpkv/consumers/attention_check.h"
#include "pcpkv/publish/backend.h"
#include "pcpkv/commands.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv_bench/consumers.h"

// The CLI sees PCPKV_HAVE_CUDA only when the build exports it; PCPKV_HAVE_NCCL (public on pcpkv_cuda)
// also proves the CUDA library is linked.
#if defined(PCPKV_HAVE_CUDA) || defined(PCPKV_HAVE_NCCL)
#define PCPKV_CLI_CUDA 1
#else
#define PCPKV_CLI_CUDA 0
#endif
#if PCPKV_CLI_CUDA
#include "pcpkv/publish/cuda_multiproc.h"  // device_free_bytes
#endif

namespace pcpkv::cli {
namespace {

struct AttentionOptions : BatchFlags {
  AttentionOptions() {
    decodes = 5;
    decode_context = 3000;  // > top-k: decodes select 2048 of their keys
    k_scale = 1.0 / 64.0;
    transport = "direct";
    backend = "cpu";  // publication backend
    seed = 1;
    tokens = 32768;  // --bench: the causal prefill
    repeats = 3;     // --bench: timed runs
  }
  std::string pcp = "1,2,4,8";        // PCP worlds to check, each against one rank
  std::string prefill = "301,77";     // prefill lengths
  int64_t prefill_context = 0;        // context of every prefill request (chunked prefill)
  std::string consumers = "cpu";      // cpu | cuda
  std::string attention_kernel = "mma";  // cuda consumers: mma | simt
  std::string bench_indexers = "exact,fp32_tree";
  std::string bench_attentions = "mma,simt";
  int32_t topk = 2048;
  int32_t dcp = 4;
  int32_t dcp_interleave = 1;
  bool no_reference = false;
  bool bench = false;
  std::vector<std::string> flags_given;  // long flags on the command line ("--k-scale"), for the notes
  bool given(const char* flag) const {
    for (const std::string& f : flags_given)
      if (f == flag) return true;
    return false;
  }
};

SparseMlaKernel parse_attention_kernel(const std::string& name, const char* flag) {
  if (name == "mma") return SparseMlaKernel::kMma;
  if (name == "simt") return SparseMlaKernel::kSimt;
  PCPKV_FAIL("{}: unknown attention kernel '{}'; known: mma, simt", flag, clip(name));
}

IndexerLogit parse_indexer_logit(const std::string& name, const char* flag) {
  if (name == "exact") return IndexerLogit::kExact;
  if (name == "fp32_tree") return IndexerLogit::kFp32Tree;
  PCPKV_FAIL("{}: unknown indexer kernel '{}'; known: exact, fp32_tree", flag, clip(name));
}

// ---- memory, estimated from the flags before anything is allocated ---------------------------------
//
// Everything in long double: --prefill 99999999999 must give a message, not an overflow. The estimate adds
// up what is alive at the check's peak (run_attention_check in src/consumers/checks/attention_check.cpp: plans, inputs,
// P + 1 cache replicas, the CPU publisher's scratch, queries, the one-rank, gathered and reference outputs
// with the reference's fp64 error statistics, the indexer scores [N, max_keys] and, with --dcp D, D shards
// of outputs), so it is an upper bound of the peak RSS rather than a guess at it.
// Measured with /usr/bin/time -f %M (glm-5, CPU publisher and consumers, this 2-core machine), estimate /
// peak RSS:
//   (defaults: --pcp 1,2,4,8 --prefill 301,77 --decodes 5 --dcp 4):           0.78 / 0.63 GB (+23%)
//   --pcp 1,2 --prefill 1000 --decodes 5:                                      1.89 / 1.53 GB (+24%)
//   --pcp 8 --prefill 4000 --decodes 0 --dcp 1 --no-reference --transport collect --topk 64:
//                                                                              2.01 / 1.64 GB (+22%)
//   --pcp 4 --prefill 100 --decodes 20 --decode-context 20000 --topk 64 --dcp 2:
//                                                                              2.01 / 1.88 GB (+7%)
//   --pcp 1,8 --prefill 1500 --decodes 3 --kv-format bf16 --transport staging --topk 128 --dcp 2:
//                                                                              2.30 / 1.80 GB (+28%)
// so the estimate is 7% to 28% above the measured peak (least when the cache replicas dominate).

// The batch the flags describe: footprint.h's BatchShape (no request is stored yet: --decodes 2000000000 is
// sized, not built); decode i has context --decode-context + 13 i.

// What the estimate needs besides the batch.
struct EstimateInputs {
  long double q_rank = 0, heads = 0, index_heads = 0, topk = 0, dcp = 1;
  long double mla_row = 0, transport_row = 0;
  Transport transport = Transport::kDirect;
  bool cpu_publisher = true;   // the CPU backend keeps per-rank scratch on the host
  bool check_reference = true;
};

constexpr long double kBaseBytes = 64e6L;  // binary, libraries, thread stacks, allocator slack

// Plan vectors: global positions/slots/request (20 B per token), per rank positions/slots/global_index and
// the gathered slot mapping (32 B per local row), block tables (4 B per block), requests (~80 B each).
long double plan_bytes(const BatchShape& b, int64_t pcp) {
  return 20 * b.tokens + 32.0L * pcp * b.max_local_tokens(pcp) + 4 * b.blocks + 80 * b.requests;
}

// One replica: the MLA and indexer-K caches of every block (+ guard bytes).
long double replica_bytes(const BatchShape& b, const EstimateInputs& e) {
  return b.slots() * (e.mla_row + kIndexerSlotBytes) + 4096;
}

// Host memory of one PCP world's check. `first`: the first world also runs the CPU reference and DCP.
MemoryEstimate host_estimate(const BatchShape& b, int64_t pcp, bool first, const EstimateInputs& e) {
  const long double N = b.tokens, M = b.max_local_tokens(pcp), P = static_cast<long double>(pcp);
  const long double mk = b.max_keys, Hq = e.heads, Hi = e.index_heads, topk = e.topk;
  const long double in_row = (e.q_rank + kKvLoraRank + kRopeDims + kIndexHeadDim) * 2;  // bf16 activations
  const long double out_row = Hq * (512 * 4 + 4);                                     // fp32 out + lse
  const long double query_row = Hi * (128 + 8) + Hq * 576 * 2;                        // fp8 + scale + weight, bf16 q
  const bool reference = first && (e.check_reference || e.dcp > 1);
  const bool dcp = first && e.dcp > 1;
  MemoryEstimate m;
  m.add("base", kBaseBytes);
  m.add("plans", plan_bytes(b, pcp) + plan_bytes(b, 1));
  m.add("inputs", N * (in_row + 8));
  m.add("rope table", mk * 64 * 4);
  m.add("cache replicas", (P + 1) * replica_bytes(b, e));
  if (e.cpu_publisher) {
    // Each rank's local inputs (the one-rank run's rank 0 holds all N), kept by the backend across calls.
    long double scratch = (P * M + N) * (in_row + 16);
    if (e.transport == Transport::kCollect) scratch += (P * M * (1 + P) + 2 * N) * (kKvLoraRank + kRopeDims + kIndexHeadDim) * 2;
    if (e.transport == Transport::kStaging) scratch += (2 * P * P * M + 2 * N) * e.transport_row;
    m.add("publisher scratch", scratch);
  }
  m.add("queries", N * query_row);
  // serve(): the largest call's local copies of the queries, one rank's outputs in the PCP loop.
  m.add("serving buffers", (N + M) * (query_row + 12) + M * (out_row + 8 * topk + 8));
  // One-rank and gathered outputs; the reference's outputs and fp64 statistics; the merged DCP output.
  long double outs = N * (out_row + 8 * topk + 8) + N * (out_row + 4 * topk + 1);
  if (reference) outs += N * (out_row + 8 * topk + 8) + N * Hq * (512 * 8 + 8);
  if (dcp) outs += N * out_row;
  m.add("attention outputs", outs);
  long double scores = 0;
  if (first && e.check_reference) scores += N * mk * 4;  // the one-rank run's scores
  if (reference) scores += N * mk * 4;                   // the reference's
  m.add("indexer scores", scores);
  if (dcp) {
    m.add("DCP shards", e.dcp * N * out_row + N * topk * 4 + b.slots() * 8 + b.positions * 16 +
                            replica_bytes(b, e) / e.dcp + b.block_size * e.mla_row);
  }
  return m;
}

// Device memory of one PCP world's check: the CUDA publisher (P ranks on one GPU, freed after each
// publication) or the CUDA consumers (each call uploads what it reads), whichever is larger.
MemoryEstimate device_estimate(const BatchShape& b, int64_t pcp, bool first, const EstimateInputs& e, bool publisher,
                               bool consumers) {
  const long double N = b.tokens, M = b.max_local_tokens(pcp), P = static_cast<long double>(pcp);
  const long double mk = b.max_keys, Hq = e.heads, Hi = e.index_heads, topk = e.topk;
  const long double out_row = Hq * (512 * 4 + 4);
  const long double slots = b.slots();
  MemoryEstimate pub, idx, att, merge;
  if (publisher) {
    const long double in_row = (e.q_rank + kKvLoraRank + kRopeDims + kIndexHeadDim) * 2 + 16;
    pub.add("cache replicas", P * replica_bytes(b, e));
    pub.add("staging buffers", P * 2 * P * M * e.transport_row);
    pub.add("rank inputs and q_c_out", P * M * (in_row + e.q_rank * 2));
    pub.add("collect buffers", P * M * (1 + P) * (kKvLoraRank + kRopeDims + kIndexHeadDim) * 2);
    pub.add("rope table", mk * 64 * 4);
  }
  if (consumers) {
    idx.add("indexer queries", N * (Hi * 136 + 12));
    idx.add("indexer-K cache", slots * kIndexerSlotBytes);
    idx.add("top-k", N * topk * 8);
    idx.add("indexer scores", (first && e.check_reference ? N * mk * 4 : 0) + std::min(N * mk * 4, 1073741824.0L));
    att.add("attention queries", N * Hq * 576 * 2);
    att.add("MLA cache", slots * e.mla_row);
    att.add("top-k", N * topk * 4);
    att.add("attention outputs", N * out_row);
    if (first && e.dcp > 1) merge.add("DCP shard outputs", (e.dcp + 1) * N * out_row);
  }
  MemoryEstimate* worst = &pub;
  for (MemoryEstimate* x : {&idx, &att, &merge})
    if (x->total() > worst->total()) worst = x;
  return *worst;
}

// --bench: one causal prefill of T tokens (bench/cuda/sparse_mla_bench.cu): host caches and tables; on the
// device the caches, queries, top-k, the indexer's score workspace (up to 8 GiB) and the outputs, or the
// 4 GiB of the copy-bandwidth probe, whichever is larger.
void bench_estimates(long double T, const EstimateInputs& e, MemoryEstimate* host, MemoryEstimate* device) {
  const long double slots = std::ceil(T / 64) * 64;
  host->add("base", kBaseBytes);
  host->add("caches", slots * (e.mla_row + kIndexerSlotBytes));
  host->add("positions and tables", T * 12 + slots / 16);
  MemoryEstimate run;
  run.add("caches", slots * (e.mla_row + kIndexerSlotBytes));
  run.add("queries", T * (12 + e.index_heads * 136 + e.heads * 576 * 2));
  run.add("top-k", T * e.topk * 4);
  run.add("indexer workspace", std::max(T * 4, std::min(T * T * 4, 8.0L * 1073741824.0L)));
  run.add("attention outputs", T * e.heads * (512 * 4 + 4));
  if (run.total() >= 4.0L * 1073741824.0L) {
    *device = run;
  } else {
    device->add("copy-bandwidth probe", 4.0L * 1073741824.0L);
  }
}

// Free memory of device 0 (where the attention check and bench run), or -1 when none is usable.
long double device_free_memory() {
#if PCPKV_CLI_CUDA
  std::string why;
  if (!cuda_backend_available(&why)) return -1;
  return static_cast<long double>(cuda::device_free_bytes());
#else
  return -1;
#endif
}

// Refuses a batch that does not fit this machine's memory (host, and device 0 for the CUDA paths), naming
// the flags that size it. Runs before any request is stored.
void check_memory(const AttentionOptions& o, const std::vector<int64_t>& worlds, const BatchShape& b,
                  EstimateInputs e) {
  std::string flags = fmt::format("--prefill '{}'", o.prefill);
  if (o.prefill_context > 0) flags += fmt::format(" --prefill-context {}", o.prefill_context);
  flags += fmt::format(" --decodes {}", o.decodes);
  if (o.decodes > 0) flags += fmt::format(" --decode-context {}", o.decode_context);
  flags += fmt::format(" --pcp {} --block-size {} --topk {}", o.pcp, o.block_size, o.topk);
  if (o.dcp > 1) flags += fmt::format(" --dcp {}", o.dcp);
  if (o.no_reference) flags += " --no-reference";
  const std::string hint =
      "; give fewer or shorter requests (--prefill, --decodes, --decode-context), a smaller --pcp, --dcp 1 or "
      "--no-reference";
  std::string why_no_cuda;
  const bool gpu_publisher = o.backend == "cuda" || (o.backend == "auto" && cuda_backend_available(&why_no_cuda));
  const bool gpu_consumers = o.consumers == "cuda";
  e.cpu_publisher = !gpu_publisher;
  MemoryEstimate worst;
  int64_t worst_world = worlds.front();
  for (size_t i = 0; i < worlds.size(); ++i) {
    MemoryEstimate m = host_estimate(b, worlds[i], i == 0, e);
    if (i == 0 || m.total() > worst.total()) {
      worst = m;
      worst_world = worlds[i];
    }
  }
  const HostMemory host = available_host_memory();
  check_memory_fits(flags, fmt::format("the check (at PCP {})", worst_world), "host", worst, host.bytes, host.source,
                    hint);
  if (!gpu_publisher && !gpu_consumers) return;
  const long double free = device_free_memory();
  if (free < 0) return;  // no usable device: the CUDA path says why when it starts
  MemoryEstimate dev;
  for (size_t i = 0; i < worlds.size(); ++i) {
    MemoryEstimate m = device_estimate(b, worlds[i], i == 0, e, gpu_publisher, gpu_consumers);
    if (i == 0 || m.total() > dev.total()) {
      dev = m;
      worst_world = worlds[i];
    }
  }
  check_memory_fits(flags, fmt::format("the check (at PCP {})", worst_world), "device", dev, free,
                    "free on device 0", hint);
}

void check_bench_memory(const AttentionOptions& o, const EstimateInputs& e) {
  const std::string flags =
      fmt::format("--bench --tokens {} --topk {} --model {} --kv-format {}", o.tokens, o.topk, o.model, o.kv_format);
  MemoryEstimate host, device;
  bench_estimates(static_cast<long double>(o.tokens), e, &host, &device);
  const HostMemory avail = available_host_memory();
  check_memory_fits(flags, "the bench", "host", host, avail.bytes, avail.source, "; give fewer --tokens");
  const long double free = device_free_memory();
  if (free >= 0) check_memory_fits(flags, "the bench", "device", device, free, "free on device 0", "; give fewer --tokens");
}

// The flags, parsed and checked: what the check and the bench run from.
struct CheckedOptions {
  AttentionCheckConfig cfg;          // plan.pcp_world unset (one per entry of worlds)
  std::vector<int64_t> worlds;       // --pcp
  ConsumerBenchConfig bench;         // --bench
  SparseMlaKernel attention_kernel = SparseMlaKernel::kMma;
  std::vector<std::string> notes;    // flags given that this mode or format does not use ("note: ...")
};

// Flags given on the command line that the run will not use: say so rather than ignore them silently
// (as `pcpkv run` does).
std::vector<std::string> unused_flag_notes(const AttentionOptions& o, KvFormat kv_format) {
  std::vector<std::string> notes;
  if (o.bench) {
    // --bench times one causal prefill of --tokens tokens with fixed scales (bench/cuda/sparse_mla_bench.cu).
    for (const char* flag : {"--pcp", "--prefill", "--prefill-context", "--decodes", "--decode-context",
                             "--block-size", "--ds-mla-scale", "--k-scale", "--transport", "--backend",
                             "--consumers", "--attention-kernel", "--dcp", "--dcp-interleave", "--no-reference"}) {
      if (o.given(flag))
        notes.push_back(fmt::format("{}: not used by --bench (it times one causal prefill of --tokens tokens)", flag));
    }
    return notes;
  }
  notes = unused_format_flag_notes(kv_format, o.given("--ds-mla-scale"), o.given("--k-scale"));
  for (const char* flag : {"--bench-indexers", "--bench-attentions", "--tokens", "--repeats"}) {
    if (o.given(flag)) notes.push_back(fmt::format("{}: not used: it applies to --bench", flag));
  }
  if (o.given("--attention-kernel") && o.consumers != "cuda")
    notes.push_back("--attention-kernel: not used: it applies to --consumers cuda");
  if (o.given("--dcp-interleave") && o.dcp == 1)
    notes.push_back("--dcp-interleave: not used: it applies to the DCP check (--dcp > 1)");
  return notes;
}

// Every flag, before anything is built or printed: a bad one is refused naming the flag and its value
// (the library's own checks would name internal fields, e.g. "dcp_world", and come after the header line).
CheckedOptions check_flags(const AttentionOptions& o) {
  CheckedOptions c;
  (void)preset(o.model);  // "--model: unknown model ..."
  PCPKV_CHECK(o.topk >= 1 && o.topk <= 8192, "--topk: must be in [1, 8192], got {}", o.topk);
  PCPKV_CHECK(o.dcp >= 1 && o.dcp <= 64, "--dcp: must be in [1, 64] (1: off), got {}", o.dcp);
  PCPKV_CHECK(o.dcp_interleave >= 1, "--dcp-interleave: must be >= 1, got {}", o.dcp_interleave);
  // Checked as given: a value below the smallest float would round to 0 and be refused later under the internal name.
  if (const auto why = scale_problem(o.k_scale)) PCPKV_FAIL("--k-scale: {}, got {}", *why, o.k_scale);
  check_block_size_flag(o.block_size);
  c.cfg.fmt.kv_format = parse_kv_format(o.kv_format, "kv-format");
  c.cfg.fmt.ds_mla_scale = parse_ds_mla_scale(o.ds_mla_scale, "ds-mla-scale");
  c.cfg.fmt.k_scale = static_cast<float>(o.k_scale);
  c.cfg.fmt.has_indexer = true;
  c.cfg.transport = parse_transport(o.transport);  // "--transport: unknown transport ..."
  check_backend_name(o.backend);
  PCPKV_CHECK(o.consumers == "cpu" || o.consumers == "cuda", "--consumers: unknown '{}'; known: cpu, cuda",
              clip(o.consumers));
  c.attention_kernel = parse_attention_kernel(o.attention_kernel, "--attention-kernel");
  c.bench.indexers.clear();  // the config's defaults: replaced by the flags'
  c.bench.attentions.clear();
  for (const std::string& n : split_list(o.bench_indexers, "--bench-indexers"))
    c.bench.indexers.push_back(parse_indexer_logit(n, "--bench-indexers"));
  for (const std::string& n : split_list(o.bench_attentions, "--bench-attentions"))
    c.bench.attentions.push_back(parse_attention_kernel(n, "--bench-attentions"));
  PCPKV_CHECK(o.tokens >= 1 && o.tokens < (int64_t{1} << 31), "--tokens: must be in [1, 2^31), got {}",
              o.tokens);
  check_run_count("--repeats", o.repeats, 1);

  c.worlds = parse_int_list(o.pcp, "--pcp", 1, 64);
  const std::vector<int64_t> prefills =
      parse_int_list(o.prefill, "--prefill", 1, std::numeric_limits<int64_t>::max(), /*none=*/"");
  PCPKV_CHECK(o.prefill_context >= 0, "--prefill-context: must be >= 0, got {}", o.prefill_context);
  PCPKV_CHECK(o.decodes >= 0, "--decodes: must be >= 0, got {}", o.decodes);
  PCPKV_CHECK(o.decodes == 0 || o.decode_context >= 1, "--decode-context: must be >= 1, got {}", o.decode_context);
  BatchShape shape(o.block_size);
  shape.max_keys = 1;  // the indexer's score rows are at least one key wide
  for (int64_t len : prefills) shape.add({RequestKind::kPrefill, len, o.prefill_context});
  shape.add_decodes(o.decodes, static_cast<long double>(o.decode_context), 13);
  c.cfg.plan.block_size = o.block_size;
  c.cfg.plan.seed = o.seed;
  c.cfg.topk = o.topk;
  c.cfg.dcp_world = o.dcp;
  c.cfg.dcp_interleave = o.dcp_interleave;
  c.cfg.seed = o.seed;
  c.cfg.check_reference = !o.no_reference;

  c.bench.num_tokens = o.tokens;
  c.bench.kv_format = c.cfg.fmt.kv_format;
  c.bench.topk = o.topk;
  c.bench.repeats = o.repeats;
  c.bench.seed = o.seed;

  const ModelConfig model = preset(o.model);
  EstimateInputs e;
  e.q_rank = static_cast<long double>(model.q_lora_rank);
  e.heads = static_cast<long double>(model.num_attention_heads);
  e.index_heads = static_cast<long double>(model.index_n_heads);
  e.topk = o.topk;
  e.dcp = o.dcp;
  e.mla_row = static_cast<long double>(mla_row_bytes(c.cfg.fmt.kv_format));
  e.transport_row = static_cast<long double>(transport_row_layout(c.cfg.fmt).row_bytes);
  e.transport = c.cfg.transport;
  e.check_reference = !o.no_reference;
  c.notes = unused_flag_notes(o, c.cfg.fmt.kv_format);
  if (o.bench) {
    check_bench_memory(o, e);
    return c;
  }
  PCPKV_CHECK(!prefills.empty() || o.decodes > 0, "the batch is empty: give --prefill lengths or --decodes");
  // Sized from the flags before any request is stored or planned (a plan allocates per token and block).
  check_memory(o, c.worlds, shape, e);
  for (int64_t len : prefills) c.cfg.plan.requests.push_back({RequestKind::kPrefill, len, o.prefill_context});
  for (int32_t i = 0; i < o.decodes; ++i)
    c.cfg.plan.requests.push_back({RequestKind::kDecode, 1, o.decode_context + 13 * int64_t{i}});
  // Plans are cheap: build each now, so a batch that cannot be planned, or reaches past the model's positions
  // (the publication refused it after the header), is refused before the header.
  const std::string batch = fmt::format("--prefill {} --prefill-context {} --decodes {} --decode-context {} (model {})",
                                        clip(o.prefill), o.prefill_context, o.decodes, o.decode_context, model.name);
  for (int64_t w : c.worlds) {
    PlanConfig pc = c.cfg.plan;
    pc.pcp_world = static_cast<int32_t>(w);
    validate_positions(make_plan(pc), model.max_position_embeddings, batch);
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
  fmt::print("pcpkv attention --bench: {} one layer, {} tokens (one causal prefill), top-k {}, {}\n", model.name,
             c.bench.num_tokens, c.bench.topk, o.kv_format);
  for (const std::string& n : c.notes) fmt::print("note: {}\n", n);
  std::fflush(stdout);  // the header survives a run that is stopped
  const ConsumerBenchResult r = cuda::bench_consumers(c.bench, model);
  std::fputs("\n", stdout);
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
  for (const std::string& n : c.notes) fmt::print("note: {}\n", n);
  std::fflush(stdout);  // the header survives a run that is stopped
  bool ok = true;
  for (size_t i = 0; i < c.worlds.size(); ++i) {
    // Progress on stderr: each world publishes and serves a whole batch (minutes for large ones).
    print_stderr(fmt::format("pcpkv attention: PCP {} ({} of {})...\n", c.worlds[i], i + 1, c.worlds.size()));
    AttentionCheckConfig cfg = c.cfg;
    cfg.plan.pcp_world = static_cast<int32_t>(c.worlds[i]);
    // The reference and DCP checks do not depend on P: run them once.
    if (i > 0) {
      cfg.check_reference = false;
      cfg.dcp_world = 1;
    }
    const AttentionCheckReport rep = run_attention_check(cfg, model, *publisher, *consumers);
    std::fputs(rep.describe().c_str(), stdout);
    std::fflush(stdout);
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
  using F = BatchFlag;
  add_batch_flags(sub, *o, {F::kModel});
  sub->add_option("--pcp", o->pcp, "Comma list of PCP world sizes, each checked against one rank")
      ->capture_default_str();
  sub->add_option("--prefill", o->prefill, "Comma list of prefill lengths (empty: none)")->capture_default_str();
  sub->add_option("--prefill-context", o->prefill_context, "Context already cached for every prefill (chunked prefill)")
      ->capture_default_str();
  add_batch_flags(sub, *o,
                  {F::kDecodes, F::kDecodeContext, F::kBlockSize, F::kKvFormat, F::kDsMlaScale, F::kKScale,
                   F::kTransport, F::kBackend},
                  {{F::kDecodeContext, "Context of decode i: this + 13*i"},
                   {F::kTransport, "Publication transport: collect | staging | direct"},
                   {F::kBackend, "Publication backend: auto | cpu | cuda"}});
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
  add_batch_flags(sub, *o, {F::kSeed}, {{F::kSeed, "Seed of inputs, queries, context rows and block tables"}});
  sub->add_flag("--no-reference", o->no_reference, "Skip the CPU reference comparison (large batches)");
  sub->add_flag("--bench", o->bench, "Time the CUDA indexer and attention for one layer instead of checking");
  add_batch_flags(sub, *o, {F::kTokens, F::kRepeats},
                  {{F::kTokens, "--bench: tokens of the causal prefill"}, {F::kRepeats, "--bench: timed runs (median)"}});
  sub->callback([o, sub] {
    o->flags_given.clear();
    for (const CLI::Option* opt : sub->get_options()) {
      if (opt->count() > 0 && !opt->get_lnames().empty()) o->flags_given.push_back("--" + opt->get_lnames().front());
    }
    const CheckedOptions c = check_flags(*o);  // throws pcpkv::Error (exit code 2) before anything is printed
    const int code = o->bench ? run_bench(*o, c) : run_checks(*o, c);
    if (code != 0) throw CLI::RuntimeError("", code);
  });
}

}  // namespace pcpkv::cli
