// The main job of `pcpkv run`: prepare (validate everything, write nothing), publish
// with each transport, run the single-rank references, and check the results (pcpkv/publish/checks.h).
#include "run_job.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <numeric>
#include <tuple>
#include <utility>

#include <fmt/ranges.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/core/error.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/inputs_io.h"
#include "pcpkv/core/safetensors.h"
#include "pcpkv/publish/checks.h"
#include "pcpkv/publish/replica_hash.h"
#include "footprint.h"
#include "pcpkv/publish/transport_choice.h"
#include "progress.h"

namespace pcpkv::cli {
namespace {

void step(Progress* p, std::string what) {
  if (p) p->step(std::move(what));
}

// "1 key", "3 keys".
std::string count_of(int64_t n, const char* noun) { return fmt::format("{} {}{}", n, noun, n == 1 ? "" : "s"); }

// Flips one byte of the last rank's MLA allocation: a byte of the first token's row ("row") or the first
// guard byte ("guard"). Proves the checks catch a corrupted replica.
void inject_fault(PublishResult& r, const PcpPlan& plan, const std::string& kind) {
  std::vector<uint8_t>& alloc = r.mla_alloc.back();
  const int64_t off = kind == "guard" ? 0 : r.mla_cache_offset + r.mla_geometry.row_offset(plan.global_slots[0]) + 7;
  alloc.at(static_cast<size_t>(off)) ^= 0x01;
}


// ---- checks made before anything is allocated or written ------------------------------------------

// Resident memory of this process now (binary, shared libraries, the config): the baseline the run's
// allocations come on top of. 0 when /proc is unreadable.
long double resident_bytes() {
  std::ifstream in("/proc/self/statm");
  long double pages_total = 0, pages_resident = 0;
  if (!(in >> pages_total >> pages_resident)) return 0;
  const long page = ::sysconf(_SC_PAGE_SIZE);
  return pages_resident * static_cast<long double>(page > 0 ? page : 4096);
}

// Peak resident memory of a run, estimated request by request before the plan exists (the plan itself
// allocates per token and per block). In long double: flags like --tokens 99999999999 must give a
// message, not an overflow.
//
// What a run holds at its peak (the last transport's single-rank reference publication and its checks),
// with N new tokens, W ranks, M max_local_tokens, S cache slots, q = q_lora_rank:
//   inputs              N * (2 * (q + 512 + 64 [+ 128 indexer K]) + 8)     GlobalInputs
//   per-rank inputs     (W * M + N) * (that + 8)       the CPU backend's per-rank copies (RankInputs, with
//                                                      slots), rank 0's grown to N by the PCP-1 reference
//   cache replicas      (W + 1 + T - 1) * S * (MLA row + 132)  W replicas, the reference's, and rank 0's
//                                                      copy kept for each of the other T - 1 transports
//   q_c outputs         (W * M + N) * q * 2 [+ W * M * index_topk * 4 with --topk-fill]
//   collect buffers     W * (W + 1) * M * 2 * (512 + 64 [+ 128]) + 2 * N * that  (kept by the backend)
//   staging buffers     W * W * M * transport row      (the half of the double buffer layer 0 touches)
//   checks, plan, RoPE  2 * M * q * 2 + S, 2 * (20 N + 32 W M) + 8 * blocks, positions * 256
//   process baseline    resident_bytes() when the estimate is made + 96 MB for what the runtime adds later
// plus a 10% margin on everything but the baseline (allocator slack). Measured (/usr/bin/time %M, CPU
// backend, 2 threads, glm-5 at --pcp 8 with 4 decodes unless noted), estimate / peak:
//   --tokens 131072 (all transports)   8.43 / 7.42 GB = 1.14    --tokens 65536 --transport direct   1.11
//   --tokens 131072 --transport direct 5.03 / 4.52 GB = 1.11    --tokens 65536 --transport staging  1.10
//   --tokens 65536 --transport collect 3.75 / 3.30 GB = 1.14    --tokens 65536 --pcp 1              1.33
//   --tokens 0 --decodes 32 --decode-context 16000 --pcp 4      3.29 / 3.01 GB = 1.09
//   --tokens 65536 --topk-fill --pcp 2 --kv-format bf16         4.09 / 3.69 GB = 1.11
// so the estimate stays >= the measured peak with a margin of at least 9% (tests/cli/test_cli_run_edge_cases.cpp
// keeps these peaks as lower bounds). The CUDA backend keeps host copies of the same results and a
// single-rank CPU reference, so the same model bounds its host memory too (not measured: no GPU here).
struct Footprint {
  int32_t pcp = 1;
  int64_t q_lora_rank = 0;
  int64_t index_topk = 0;  // > 0 with --topk-fill on an indexer layer
  CacheFormat fmt;
  bool collect = false, staging = false;
  int64_t num_transports = 1;
  BatchShape shape;  // footprint.h

  std::string partial;  // when the count stopped early: which requests it covers

  explicit Footprint(int64_t block_size) : shape(static_cast<long double>(block_size)) {}
  /// Adds `count` requests like `r`.
  void add(const RequestSpec& r, long double count = 1) { shape.add(r, count); }
  long double local_rows() const { return pcp * shape.max_local_tokens(pcp); }  // W * M

  // Calls add(name, bytes) for each part of the estimate but the process baseline, margin included.
  template <class Add>
  void parts(Add&& add) const {
    constexpr long double kMargin = 1.10L;
    const long double W = pcp, M = shape.max_local_tokens(pcp), N = shape.tokens, q = q_lora_rank;
    const RowBytes row = RowBytes::of(fmt, q);
    const long double input_row = row.input + 8;  // + position and slot
    add("inputs", kMargin * N * input_row);
    add("per-rank input copies", kMargin * (local_rows() + N) * (input_row + 8));
    add("cache replicas", kMargin * (W + static_cast<long double>(num_transports)) * row.replica(shape.slots()));
    add("q_c outputs", kMargin * (local_rows() + N) * q * 2);
    add("top-k buffers", kMargin * local_rows() * index_topk * 4);
    if (collect) add("collect buffers", kMargin * (W * (W + 1) * M + 2 * N) * row.bf16);
    if (staging) add("staging buffers", kMargin * W * W * M * row.transport);
    add("checks/plan/RoPE table", kMargin * (4 * M * q + shape.slots() + 2 * (20 * N + 32 * W * M) +
                                             8 * shape.blocks + 256 * shape.max_keys));
  }
  long double model_bytes() const {
    long double total = 0;
    parts([&](const char*, long double bytes) { total += bytes; });
    return total;
  }
  MemoryEstimate estimate(long double baseline) const {
    MemoryEstimate e;
    parts([&](const char* name, long double bytes) { e.add(name, bytes); });
    e.add("process baseline", baseline);
    return e;
  }
};

// Refuses a batch whose block ids overflow the int32 block tables or whose estimated peak memory exceeds
// what this machine has available (or --memory-limit-gb). `batch` names the flags (or the file) the batch
// came from; from_file: an --inputs file describes it (the refusal's hint then points there). Returns the estimate and the limit, for the report.
std::pair<long double, long double> check_footprint(const Footprint& f, const std::string& batch,
                                                    double memory_limit_gb, bool from_file) {
  constexpr auto kMaxBlocks = static_cast<long double>(std::numeric_limits<int32_t>::max());
  PCPKV_CHECK(f.shape.blocks <= kMaxBlocks,
              "{}: the cache needs at least {:.0f} blocks of {} slots{}, more than the {} block ids an int32 block "
              "table holds",
              batch, static_cast<double>(f.shape.blocks), static_cast<double>(f.shape.block_size), f.partial, std::numeric_limits<int32_t>::max());
  HostMemory have = available_host_memory();
  if (memory_limit_gb > 0 && memory_limit_gb * 1e9L < have.bytes) {
    have.bytes = memory_limit_gb * 1e9L;
    have.source = fmt::format("--memory-limit-gb {}", memory_limit_gb);
  }
  // The resident set grows after this point by more than the run's buffers: worker threads' stacks, library
  // pages touched on first use (the CUDA runtime probe of backend auto, cuBLASLt). Measured: a 1-token run
  // estimated 162 MB peaked at 223 MB (/usr/bin/time %M, the CUDA build on a machine without a GPU).
  constexpr long double kRuntimeAllowance = 96.0L * (1 << 20);
  const long double baseline = resident_bytes() + kRuntimeAllowance;
  const MemoryEstimate need = f.estimate(baseline);
  const std::string hint =
      baseline > 0.5L * need.total()
          ? "; most of it is the process itself (libraries, threads): free memory or raise --memory-limit-gb"
          : from_file ? "; give a smaller batch in the --inputs file, a smaller --pcp or fewer transports"
                      : "; give fewer --tokens or --decodes, a smaller --pcp or fewer transports";
  check_memory_fits(batch, "the run" + f.partial, "host", need, have.bytes, have.source, hint);
  return {need.total(), have.bytes};
}

// --save: the directory must exist and take a new file, and the target, when present, must be a regular
// file (renaming over a device or a FIFO would replace it). Probes with the writer's temporary name, so
// a run is not computed only to fail at the end.
void check_save_target(const std::string& file) {
  namespace fs = std::filesystem;
  const std::string path = clip(file);  // as messages quote it (kMaxQuotedChars)
  std::error_code ec;
  PCPKV_CHECK(!fs::is_directory(file, ec), "--save: '{}' is a directory", path);
  const fs::file_status st = fs::status(file, ec);
  PCPKV_CHECK(!fs::exists(st) || fs::is_regular_file(st),
              "--save: '{}' exists and is not a regular file (a device, FIFO or socket); pcpkv replaces the file "
              "at that path, so it refuses",
              path);
  fs::path target;
  try {
    target = write_target(file);
  } catch (const Error& e) {
    throw Error(std::string("--save: ") + e.what(), e.where());
  }
  const fs::path dir = fs::absolute(target, ec).parent_path();
  PCPKV_CHECK(fs::exists(dir, ec), "--save: directory '{}' of '{}' does not exist", clip(dir.string()), path);
  PCPKV_CHECK(fs::is_directory(dir, ec), "--save: '{}' (the directory of '{}') is not a directory", clip(dir.string()),
              path);
  const std::string probe = fmt::format("{}.tmp.{}", target.string(), static_cast<long>(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  PCPKV_CHECK(fd >= 0, "--save: cannot create a file next to '{}' (tried '{}'): {}", path, clip(probe),
              std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace

bool RunOutcome::ok() const { return all_pass(checks); }

Topology one_process_topology(int32_t pcp) {
  // `pcpkv run`'s P logical ranks live in one process on one device (the CPU or one GPU): every rank's replica
  // is plain memory of that device to every other rank.
  char host[256] = {};
  const std::string name = ::gethostname(host, sizeof(host) - 1) == 0 && host[0] ? host : "localhost";
  Topology t;
  t.hosts.assign(static_cast<size_t>(std::max(pcp, 1)), name);
  t.peer_access.assign(t.hosts.size(), std::vector<bool>(t.hosts.size(), true));
  return t;
}

PreparedRun prepare_run(const RunOptions& o, Progress* progress) {
  PreparedRun p;
  p.opts = o;
  step(progress, "checking flags");
  // Flags first, cheapest checks first: nothing is read or written before they pass.
  PCPKV_CHECK(o.pcp >= 1, "--pcp: must be >= 1, got {}", o.pcp);
  PCPKV_CHECK(o.pcp <= 1024, "--pcp: {} ranks is more than pcpkv supports (1024)", o.pcp);
  check_block_size_flag(o.block_size);
  PCPKV_CHECK(o.tokens >= 0, "--tokens: must be >= 0, got {}", o.tokens);
  PCPKV_CHECK(o.decodes >= 0, "--decodes: must be >= 0, got {}", o.decodes);
  const LocalOrder local_order = parse_local_order(o.local_order, "--local-order");
  const DecodeOwnership decode_ownership = parse_decode_ownership(o.decode_ownership, "--decode-ownership");
  PCPKV_CHECK(o.decode_context >= -1,
              "--decode-context: must be >= -1 (-1: context 1000*(i+1)+7*i for decode i; >= 0: that context for "
              "every decode), got {}",
              o.decode_context);
  PCPKV_CHECK(std::isfinite(o.memory_limit_gb) && o.memory_limit_gb >= 0,
              "--memory-limit-gb: must be a finite number >= 0 (0: this machine's available memory), got {}",
              o.memory_limit_gb);
  check_run_count("--repeats", o.repeats, 1);
  PCPKV_CHECK(o.threads >= 0, "--threads: must be >= 0, got {}", o.threads);
  PCPKV_CHECK(o.threads <= 1024, "--threads: {} is more than pcpkv supports (1024)", o.threads);
  PCPKV_CHECK(o.inject_fault.empty() || o.inject_fault == "row" || o.inject_fault == "guard",
              "--inject-fault: must be row or guard, got '{}'", clip(o.inject_fault));
  check_backend_name(o.backend);
  p.fmt = parse_format_flags(o);
  if (o.transport == "auto") {
    const TransportChoice choice = choose_transport(one_process_topology(o.pcp));
    p.transports = {choice.transport};
    p.transport_reason = "--transport auto: " + choice.reason;
    p.notes_text.push_back(p.transport_reason);
  } else {
    p.transports = parse_transport_list(o.transport);
  }
  // Flags that do not apply to this format or layer: say so rather than ignore them silently.
  auto given = [&](const char* flag) {
    return std::find(o.flags_given.begin(), o.flags_given.end(), flag) != o.flags_given.end();
  };
  if (!o.topk_fill.empty()) p.topk_fill = parse_topk_fill(o.topk_fill, "--topk-fill");
  const bool replicas_env = replica_check_from_env();  // read even with the flag: a bad value is refused
  p.check_replicas = o.check_replicas || replicas_env;
  if (replicas_env && !o.check_replicas) p.notes_text.push_back("replica check: on (PCPKV_CHECK_REPLICAS=1)");
  if (given("--topk-fill") && !p.fmt.has_indexer) {
    p.notes_text.push_back("--topk-fill: not used: a shared layer (--layer shared) has no indexer, so no top-k buffer");
  }
  if (given("--ds-mla-scale") && p.fmt.kv_format != KvFormat::kFp8DsMla) {
    p.notes_text.push_back(fmt::format("--ds-mla-scale: not used: it applies to --kv-format fp8_ds_mla, not {}",
                                       to_string(p.fmt.kv_format)));
  }
  if (given("--k-scale") && p.fmt.kv_format != KvFormat::kFp8) {
    p.notes_text.push_back(
        fmt::format("--k-scale: not used: it applies to --kv-format fp8, not {}", to_string(p.fmt.kv_format)));
  }
  // One rule for every file a flag names (input_limits.h): a regular file, size-bounded. The inputs file has
  // no fixed bound: its header is (100 MB) and its tensors are read after the host-memory pre-check.
  if (!o.inputs.empty()) check_input_file("--inputs", o.inputs, 0);
  if (!o.config.empty()) check_input_file("--config", o.config, kMaxConfigFileBytes);
  if (!o.save.empty()) check_save_target(o.save);

  step(progress, "loading the model");
  if (!o.config.empty()) {
    p.model = load_hf_config(o.config, o.model_given ? o.model : std::string(), &p.notes, false);
    // One line per kind: a partial config can miss dozens of keys.
    auto key_list = [](const std::vector<std::string>& notes) {
      std::string s;
      for (const auto& n : notes) s += (s.empty() ? "" : ", ") + n.substr(0, n.find(" ("));
      return s;
    };
    if (!p.notes.missing.empty()) {
      p.notes_text.push_back(fmt::format("config: {} missing, preset values kept: {}",
                                         count_of(p.notes.missing.size(), "key"),
                                         key_list(p.notes.missing)));
    }
    for (const std::string& remark : p.notes.remarks) p.notes_text.push_back("config: " + remark);
    if (!p.notes.ignored.empty()) {
      p.notes_text.push_back(
          fmt::format("config: {} not used by pcpkv: {}", count_of(p.notes.ignored.size(), "key"),
                      key_list(p.notes.ignored)));
    }
  } else {
    p.model = preset(o.model);
  }
  p.model.validate();

  step(progress, "planning the batch");
  PlanConfig pc;
  pc.pcp_world = o.pcp;
  pc.block_size = o.block_size;
  pc.seed = o.seed;
  pc.local_order = local_order;
  pc.decode_ownership = decode_ownership;
  InputsBatch batch;
  if (!o.inputs.empty()) {
    batch = read_inputs_batch(o.inputs);
    for (const std::string& n : batch.notes) p.notes_text.push_back(fmt::format("--inputs {}: {}", clip(o.inputs), n));
    // Not an error: re-encoding saved activations in another format or layer kind is a use; the saved caches
    // are not read. The scale settings count only where both the file and the run use their format.
    std::vector<std::string> saved;
    auto compare = [&](const char* key, const std::string& file_value, const std::string& run_value) {
      if (file_value.empty() || file_value == run_value) return;
      saved.push_back(fmt::format("{} {} (this run: {})", key, file_value, run_value));
    };
    const std::string run_kv_format = to_string(p.fmt.kv_format);
    compare("kv_format", batch.saved_kv_format, run_kv_format);
    if (batch.saved_kv_format == run_kv_format && p.fmt.kv_format == KvFormat::kFp8DsMla)
      compare("ds_mla_scale", batch.saved_ds_mla_scale, to_string(p.fmt.ds_mla_scale));
    if (batch.saved_kv_format == run_kv_format && p.fmt.kv_format == KvFormat::kFp8)
      compare("k_scale", batch.saved_k_scale, fmt::format("{}", p.fmt.k_scale));
    compare("has_indexer", batch.saved_has_indexer, p.fmt.has_indexer ? "true" : "false");
    if (!saved.empty()) {
      p.notes_text.push_back(fmt::format(
          "--inputs {}: saved with {}: the caches are computed anew from the file's activations, so they (and a "
          "--save of this run) differ from the file's caches",
          clip(o.inputs), fmt::join(saved, ", ")));
    }
  }
  Footprint fp(o.block_size);
  fp.pcp = o.pcp;
  fp.q_lora_rank = p.model.q_lora_rank;
  fp.index_topk = !o.topk_fill.empty() && p.fmt.has_indexer ? p.model.index_topk : 0;
  fp.fmt = p.fmt;
  auto uses = [&](Transport t) { return std::find(p.transports.begin(), p.transports.end(), t) != p.transports.end(); };
  fp.collect = uses(Transport::kCollect);
  fp.staging = uses(Transport::kStaging);
  fp.num_transports = static_cast<int64_t>(p.transports.size());
  const std::string geometry = fmt::format("--pcp {} --block-size {}", o.pcp, o.block_size);
  // Saved slots and block tables are laid out for the block size they were saved with.
  PCPKV_CHECK(batch.saved_block_size == 0 || (batch.block_tables.empty() && batch.slot_mapping.empty()) ||
                  batch.saved_block_size == o.block_size,
              "--inputs {}: its {} were saved with block_size {} (the file's metadata), but --block-size is {}; "
              "run with --block-size {}",
              clip(o.inputs), batch.block_tables.empty() ? "slot_mapping" : "block_tables", batch.saved_block_size,
              o.block_size, batch.saved_block_size);
  if (!batch.requests.empty()) {
    int64_t max_context = 0;
    for (const RequestSpec& r : batch.requests) {
      fp.add(r);
      max_context = std::max(max_context, r.context_len);
    }
    std::tie(p.memory_estimate, p.memory_limit) =
        check_footprint(fp,
                        fmt::format("--inputs {} ({} requests, {} tokens, contexts up to {}) with {}", clip(o.inputs),
                                    batch.requests.size(), batch.num_tokens, max_context, geometry),
                        o.memory_limit_gb, /*from_file=*/true);
    pc.requests = batch.requests;
    p.batch_source = fmt::format("{} requests from {}", batch.requests.size(), clip(o.inputs));
    p.notes_text.push_back(
        fmt::format("batch: {} describes its requests; --tokens, --decodes and --decode-context are not used",
                    clip(o.inputs)));
  } else {
    PCPKV_CHECK(o.tokens > 0 || o.decodes > 0, "--tokens 0 --decodes 0: the batch is empty");
    // Sized before any request is stored: --decodes 2000000000 must not allocate first.
    const std::string flags = fmt::format("--tokens {} --decodes {}{} {}", o.tokens, o.decodes,
                                          o.decodes > 0 && o.decode_context >= 0
                                              ? fmt::format(" --decode-context {}", o.decode_context)
                                              : "",
                                          geometry);
    auto decode = [&](int32_t i) {
      const int64_t context = o.decode_context >= 0 ? o.decode_context : 1000 * int64_t{i + 1} + 7 * i;
      return RequestSpec{RequestKind::kDecode, 1, context};
    };
    if (o.tokens > 0) fp.add({RequestKind::kPrefill, o.tokens, 0});
    if (o.decode_context >= 0) {
      fp.add(decode(0), o.decodes);
    } else {
      // Contexts differ per decode: count them one by one, but stop once over (the loop stays short);
      // the first 1024 are always counted, so an ordinary batch's message states its whole size.
      const long double memory = available_host_memory().bytes;
      for (int32_t i = 0; i < o.decodes; ++i) {
        fp.add(decode(i));
        if (i >= 1023 && i + 1 < o.decodes &&
            (fp.shape.blocks > std::numeric_limits<int32_t>::max() || fp.model_bytes() > memory)) {
          fp.partial = fmt::format(" (counting only the first {} of the {} decodes)", i + 1, o.decodes);
          break;
        }
      }
    }
    std::tie(p.memory_estimate, p.memory_limit) = check_footprint(fp, flags, o.memory_limit_gb, /*from_file=*/false);
    if (o.tokens > 0) pc.requests.push_back({RequestKind::kPrefill, o.tokens, 0});
    for (int32_t i = 0; i < o.decodes; ++i) pc.requests.push_back(decode(i));
    p.batch_source = fmt::format("--tokens {} --decodes {}", o.tokens, o.decodes);
    if (!o.inputs.empty()) {
      const int64_t n = o.tokens + o.decodes;
      PCPKV_CHECK(batch.num_tokens == n,
                  "--inputs {}: tensor 'kv' has {} rows, but {} give {} tokens (the file has no 'requests' tensor "
                  "describing its batch)",
                  clip(o.inputs), batch.num_tokens, p.batch_source, n);
    }
  }
  p.plan = make_plan(pc);
  validate_positions(p.plan, p.model.max_position_embeddings,
                     fmt::format("{} (model {})", p.batch_source, p.model.name));
  // The file's block tables and slots replace the fresh plan's, so a run loaded from a file (and its --save)
  // keeps tables and slots that agree: slot = table[pos / B] * B + pos % B.
  const std::string origin = "--inputs " + clip(o.inputs);
  if (!batch.block_tables.empty()) {
    apply_block_tables(p.plan, batch.block_tables, origin);
    for (size_t g = 0; g < batch.slot_mapping.size(); ++g) {
      const int64_t pos = p.plan.global_positions[g];
      const int32_t r = p.plan.global_request[g];
      PCPKV_CHECK(batch.slot_mapping[g] == p.plan.global_slots[g],
                  "{}: slot_mapping[{}] = {} contradicts block_tables: token {} (request {}, position {}) lies in "
                  "block_tables[{}][{}] = {}, slot {} with --block-size {}",
                  origin, g, batch.slot_mapping[g], g, r, pos, r, pos / o.block_size,
                  p.plan.block_tables[r][pos / o.block_size], p.plan.global_slots[g], o.block_size);
    }
    validate_plan(p.plan);
    p.notes_text.push_back(fmt::format("slots: taken from {} (block_tables{})", clip(o.inputs),
                                       batch.slot_mapping.empty() ? "" : "; slot_mapping agrees"));
  } else if (!batch.slot_mapping.empty()) {
    apply_slot_mapping(p.plan, batch.slot_mapping, origin);
    validate_plan(p.plan);
    p.notes_text.push_back(
        fmt::format("slots: taken from {} (slot_mapping); the block tables follow from them", clip(o.inputs)));
  }
  p.ref_plan = single_rank_plan(p.plan);

  if (o.inputs.empty()) {
    step(progress, "generating inputs");
    p.inputs = generate_inputs(p.model, p.plan, p.fmt.has_indexer, o.seed);
    p.inputs_source = fmt::format("generated (seed {})", o.seed);
  } else {
    step(progress, "loading inputs");
    p.inputs = load_inputs(o.inputs, p.model, p.plan, p.fmt.has_indexer);
    p.inputs_source = o.inputs;
  }
  validate_inputs(p.inputs, p.model, p.plan, p.fmt.has_indexer);
  p.nonfinite = count_nonfinite(p.inputs);
  if (p.nonfinite.total() > 0) {
    PCPKV_CHECK(o.allow_nonfinite,
                "inputs ({}): {} ({}); refusing to publish them (pass --allow-nonfinite to "
                "publish anyway)",
                p.inputs_source, count_of(p.nonfinite.total(), "non-finite value"), p.nonfinite.describe());
    p.notes_text.push_back(fmt::format("inputs: {} ({}), published because of --allow-nonfinite",
                                       count_of(p.nonfinite.total(), "non-finite value"), p.nonfinite.describe()));
  }
  return p;
}

RunOutcome execute_run(const PreparedRun& prep, Progress* progress) {
  RunOutcome out;
  step(progress, "starting the backend");
  std::string why_no_cuda;
  const bool use_cpu =
      prep.opts.backend == "cpu" || (prep.opts.backend == "auto" && !cuda_backend_available(&why_no_cuda));
  std::unique_ptr<Backend> backend = use_cpu ? make_cpu_backend(prep.opts.threads) : make_backend(prep.opts.backend);
  out.backend_name = backend->name();
  out.backend_device = backend->device();
  if (prep.opts.backend == "auto" && use_cpu) out.backend_note = "cuda unavailable: " + why_no_cuda;
  std::unique_ptr<Backend> cpu_ref;
  Backend* ref_backend = backend.get();
  if (out.backend_name != "cpu") {
    cpu_ref = make_cpu_backend(prep.opts.threads);
    ref_backend = cpu_ref.get();
  }

  const int64_t topk_width = !prep.opts.topk_fill.empty() && prep.fmt.has_indexer ? prep.model.index_topk : 0;
  PublishSetup setup;
  setup.model = &prep.model;
  setup.plan = &prep.plan;
  setup.fmt = prep.fmt;
  setup.topk_width = topk_width;
  setup.topk_fill_mode = prep.topk_fill;
  setup.materialize_q = true;
  setup.repeats = prep.opts.repeats;
  PublishSetup ref_setup = setup;
  ref_setup.plan = &prep.ref_plan;
  ref_setup.topk_width = 0;
  ref_setup.repeats = 1;

  // One transport at a time: publish, reference, check, then keep only rank 0's caches (for staging ==
  // direct and --save), so memory holds one transport's W replicas at a time.
  const size_t num = prep.transports.size();
  for (size_t i = 0; i < num; ++i) {
    const Transport t = prep.transports[i];
    const std::string name = to_string(t);
    TransportRun run{t, {}, {}};
    step(progress, fmt::format("publishing with {} ({}/{}, PCP {}, {} backend)", name, i + 1, num, prep.plan.pcp_world,
                               out.backend_name));
    run.result = backend->publish(setup, prep.inputs, t);
    if (!prep.opts.inject_fault.empty()) inject_fault(run.result, prep.plan, prep.opts.inject_fault);
    step(progress, fmt::format("single-rank reference for {} ({}/{})", name, i + 1, num));
    run.reference = ref_backend->publish(ref_setup, prep.inputs, t);

    PublicationCase pc;
    pc.model = &prep.model;
    pc.plan = &prep.plan;
    pc.inputs = &prep.inputs;
    pc.fmt = prep.fmt;
    pc.topk_width = topk_width;
    pc.topk_fill = prep.topk_fill;
    pc.check_replicas = prep.check_replicas;
    pc.layer_idx = setup.layer_idx;
    for (Check& c : check_publication(run.result, run.reference, pc, [&](const std::string& what) {
           step(progress, fmt::format("verifying {}: {}", name, what));
         }))
      out.checks.push_back(std::move(c));

    run.result.mla_alloc.resize(1);
    run.result.index_alloc.resize(std::min<size_t>(run.result.index_alloc.size(), 1));
    run.result.q_c_out = {};
    run.result.topk = {};
    run.reference = {};
    out.runs.push_back(std::move(run));
  }

  const TransportRun* staging = nullptr;
  const TransportRun* direct = nullptr;
  for (const TransportRun& run : out.runs) {
    if (run.transport == Transport::kStaging) staging = &run;
    if (run.transport == Transport::kDirect) direct = &run;
  }
  if (staging && direct) {
    out.checks.push_back(check_same_caches(staging->result, direct->result, prep.fmt, "staging == direct", ""));
  }
  out.notes = check_notes(out.checks, prep.fmt.k_scale);
  return out;
}

}  // namespace pcpkv::cli
