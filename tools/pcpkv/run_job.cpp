// The main job of `pcpkv run`: prepare (validate everything, write nothing), publish
// with each transport, run the single-rank references, and check the results through verify.h.
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

#include "pcpkv/core/error.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/inputs_io.h"
#include "pcpkv/core/safetensors.h"
#include "pcpkv/publish/checks.h"
#include "progress.h"

namespace pcpkv::cli {
namespace {

void step(Progress* p, std::string what) {
  if (p) p->step(std::move(what));
}

Check make_check(std::string name, std::string transport) {
  Check c;
  c.name = std::move(name);
  c.transport = std::move(transport);
  return c;
}

// "1 key", "3 keys".
std::string count_of(int64_t n, const char* noun) { return fmt::format("{} {}{}", n, noun, n == 1 ? "" : "s"); }

std::string mb(int64_t bytes) { return fmt::format("{:.1f} MB", static_cast<double>(bytes) / 1e6); }

// Where byte `off` of an MLA allocation lies, for a first-difference message.
std::string where_mla(const PublishResult& r, int64_t off) {
  const MlaCacheGeometry& g = r.mla_geometry;
  const int64_t rel = off - r.mla_cache_offset;
  if (rel < 0) return fmt::format("byte {} (before the cache)", off);
  if (rel >= g.bytes()) return fmt::format("byte {} (after the cache)", off);
  const int64_t block = rel / g.block_stride, in_block = rel % g.block_stride;
  const int64_t row = in_block / g.row_stride;
  if (row >= g.block_size) return fmt::format("byte {} (block {} padding)", off, block);
  return fmt::format("byte {} (slot {}, byte {} of its row)", off, block * g.block_size + row, in_block % g.row_stride);
}

std::string where_index(const PublishResult& r, int64_t off) {
  const IndexerCacheGeometry& g = r.index_geometry;
  const int64_t rel = off - r.index_cache_offset;
  if (rel < 0) return fmt::format("byte {} (before the cache)", off);
  if (rel >= g.bytes()) return fmt::format("byte {} (after the cache)", off);
  const int64_t block = rel / g.block_stride, in_block = rel % g.block_stride;
  const int64_t data_bytes = int64_t{g.block_size} * kIndexHeadDim;
  if (in_block < data_bytes) {
    return fmt::format("byte {} (slot {} data, byte {})", off, block * g.block_size + in_block / kIndexHeadDim,
                       in_block % kIndexHeadDim);
  }
  if (in_block < data_bytes + int64_t{g.block_size} * 4) {
    return fmt::format("byte {} (slot {} scale)", off, block * g.block_size + (in_block - data_bytes) / 4);
  }
  return fmt::format("byte {} (block {} padding)", off, block);
}

// Accumulates byte comparisons into one check; the first difference names its place.
struct ByteTally {
  int64_t bytes = 0, diff = 0;
  std::string first;
  void add(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, const std::string& label,
           const std::function<std::string(int64_t)>& where) {
    bytes += static_cast<int64_t>(std::max(a.size(), b.size()));
    if (a.size() != b.size()) {
      diff += static_cast<int64_t>(std::max(a.size(), b.size()));
      if (first.empty()) first = fmt::format("{}: sizes differ ({} vs {} bytes)", label, a.size(), b.size());
      return;
    }
    const ByteDiff d = compare_bytes(a, b);
    diff += d.num_diff;
    if (!d.equal() && first.empty()) {
      first = fmt::format("{}: {} bytes differ, first at {}", label, d.num_diff, where(d.first_diff));
    }
  }
  void fill(Check& c, const std::string& ok_detail) const {
    c.num_bytes = bytes;
    c.num_diff = diff;
    c.pass = diff == 0;
    c.detail = c.pass ? ok_detail : first;
  }
};

std::vector<uint8_t> as_bytes(const uint16_t* p, int64_t n) {
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n * 2);
}

Check check_replicas(const PublishResult& r, const CacheFormat& fmt, int32_t world) {
  Check c = make_check("replicas identical", to_string(r.transport));
  ByteTally t;
  for (int32_t rank = 1; rank < world; ++rank) {
    t.add(r.mla_alloc[rank], r.mla_alloc[0], fmt::format("rank {} MLA vs rank 0", rank),
          [&](int64_t o) { return where_mla(r, o); });
    if (fmt.has_indexer) {
      t.add(r.index_alloc[rank], r.index_alloc[0], fmt::format("rank {} indexer vs rank 0", rank),
            [&](int64_t o) { return where_index(r, o); });
    }
  }
  std::string ok = fmt::format("{} replicas x (MLA {}{}) byte-identical", world, mb(r.mla_alloc[0].size()),
                               fmt.has_indexer ? " + indexer " + mb(r.index_alloc[0].size()) : "");
  if (world == 1) ok = "1 replica (PCP 1): nothing to compare";
  t.fill(c, ok);
  return c;
}

Check check_same_cache(const PublishResult& a, const PublishResult& b, const CacheFormat& fmt, std::string name,
                       std::string transport) {
  Check c = make_check(std::move(name), std::move(transport));
  ByteTally t;
  t.add(a.mla_alloc[0], b.mla_alloc[0], "MLA cache", [&](int64_t o) { return where_mla(a, o); });
  if (fmt.has_indexer) {
    t.add(a.index_alloc[0], b.index_alloc[0], "indexer cache", [&](int64_t o) { return where_index(a, o); });
  }
  t.fill(c, fmt::format("MLA {}{} byte-identical", mb(a.mla_alloc[0].size()),
                        fmt.has_indexer ? " + indexer " + mb(a.index_alloc[0].size()) : ""));
  return c;
}

// Rank 0's caches and every rank's q_c_out rows against the PCP-1 reference.
Check check_reference(const TransportRun& run, const PreparedRun& prep) {
  const PublishResult& r = run.result;
  const PublishResult& ref = run.reference;
  Check c = make_check("== single-rank reference", to_string(r.transport));
  ByteTally t;
  t.add(r.mla_alloc[0], ref.mla_alloc[0], "rank 0 MLA vs PCP-1", [&](int64_t o) { return where_mla(r, o); });
  if (prep.fmt.has_indexer) {
    t.add(r.index_alloc[0], ref.index_alloc[0], "rank 0 indexer vs PCP-1",
          [&](int64_t o) { return where_index(r, o); });
  }
  std::string q_note;
  const int64_t q = prep.model.q_lora_rank;
  if (!r.q_c_out.empty() && !ref.q_c_out.empty()) {
    for (int32_t rank = 0; rank < prep.plan.pcp_world; ++rank) {
      const RankPlan& rp = prep.plan.ranks[rank];
      std::vector<uint8_t> got, want;
      got.reserve(static_cast<size_t>(rp.num_local_tokens * q * 2));
      want.reserve(got.capacity());
      for (size_t i = 0; i < rp.global_index.size(); ++i) {
        const int64_t g = rp.global_index[i];
        if (g < 0) continue;
        const auto a = as_bytes(r.q_c_out[rank].data() + static_cast<int64_t>(i) * q, q);
        const auto b = as_bytes(ref.q_c_out[0].data() + g * q, q);
        got.insert(got.end(), a.begin(), a.end());
        want.insert(want.end(), b.begin(), b.end());
      }
      t.add(got, want, fmt::format("rank {} q_c_out vs PCP-1", rank),
            [&](int64_t o) { return fmt::format("local row {}, element {}", o / (2 * q), (o % (2 * q)) / 2); });
    }
    q_note = ", every rank's q_c_out rows";
  } else {
    q_note = " (q_c_out not materialized by this backend)";
  }
  t.fill(c, fmt::format("rank 0 caches{} equal the CPU PCP-1 run", q_note));
  return c;
}

Check check_guards(const PublishResult& r, const PreparedRun& prep) {
  Check c = make_check("guard/untouched bytes intact", to_string(r.transport));
  int64_t bad = 0, total = 0;
  std::string first;
  for (int32_t rank = 0; rank < prep.plan.pcp_world; ++rank) {
    const GuardReport g = check_untouched(r, rank, prep.plan, prep.fmt);
    bad += g.num_bad;
    total += static_cast<int64_t>(r.mla_alloc[rank].size() + r.index_alloc[rank].size());
    if (g.num_bad && first.empty())
      first = fmt::format("rank {}: {} bytes changed; first: {}", rank, g.num_bad, g.first);
  }
  c.num_bytes = total;
  c.num_diff = bad;
  c.pass = bad == 0;
  c.detail = c.pass ? fmt::format("every byte outside written rows is 0x{:02X} on all {} ranks", kGuardByte,
                                  prep.plan.pcp_world)
                    : first;
  return c;
}

Check check_bound(const PublishResult& r, const PreparedRun& prep) {
  const bool collect = r.transport == Transport::kCollect;
  const char* what = prep.fmt.kv_format != KvFormat::kBf16 ? "FP8" : (prep.fmt.has_indexer ? "bf16 / FP8" : "bf16");
  Check c = make_check(fmt::format("dequantized vs fp64 within the {} bound", what), to_string(r.transport));
  const Fp8Report f = check_fp8_bound(r, 0, prep.inputs, prep.plan, prep.model, prep.fmt, collect);
  c.num_values = f.num_values;
  c.num_over_bound = f.num_over_bound;
  c.num_saturated = f.num_saturated;
  c.num_flushed = f.num_flushed;
  c.max_abs_err = f.max_abs_err;
  c.max_err_over_bound = f.max_err_over_bound;
  c.pass = f.num_over_bound == 0 && f.num_values > 0;
  c.detail =
      fmt::format("max error / bound {:.3f}, {} of {} values over the bound{}, max |err| {:.3g}", f.max_err_over_bound,
                  f.num_over_bound, f.num_values,
                  f.num_saturated ? fmt::format(", {} saturated (not counted)", f.num_saturated) : "", f.max_abs_err);
  c.worst = f.worst;
  if (f.num_values == 0) c.detail = "no values checked";
  return c;
}

// Every row of every rank's buffer (padding rows too): -1 where --topk-fill fills (rows from
// topk_fill_first_row on), the backend's poison kGuardByte where it must not write.
Check check_topk(const PublishResult& r, const PreparedRun& prep, int64_t width) {
  const char* what = prep.topk_fill == TopkFill::kFull   ? "top-k buffer filled with -1 (full)"
                     : prep.topk_fill == TopkFill::kTail ? "top-k buffer: padding rows -1, local tokens' rows untouched (tail)"
                                                         : "top-k buffer untouched (none)";
  Check c = make_check(what, to_string(r.transport));
  ByteTally t;
  const int64_t M = prep.plan.max_local_tokens;
  for (int32_t rank = 0; rank < prep.plan.pcp_world && rank < static_cast<int32_t>(r.topk.size()); ++rank) {
    const int64_t n = M * width;
    const int64_t first = topk_fill_first_row(prep.topk_fill, prep.plan.ranks[rank].num_local_tokens, M);
    const auto* p = reinterpret_cast<const uint8_t*>(r.topk[rank].data());
    std::vector<uint8_t> got(p, p + std::min<int64_t>(n, static_cast<int64_t>(r.topk[rank].size())) * 4);
    std::vector<uint8_t> want(static_cast<size_t>(n * 4), 0xFF);
    std::fill(want.begin(), want.begin() + first * width * 4, kGuardByte);
    t.add(got, want, fmt::format("rank {} top-k", rank),
          [&](int64_t o) { return fmt::format("token {}, entry {}", o / (4 * width), (o % (4 * width)) / 4); });
  }
  if (r.topk.empty()) {
    c.detail = "the backend returned no top-k buffer";
    return c;
  }
  t.fill(c, fmt::format("{} int32 per row, {} rows per rank", width, prep.plan.max_local_tokens));
  return c;
}

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
// so the estimate stays >= the measured peak with a margin of at least 9% (tests/unit/test_cli_run_edge_cases.cpp
// keeps these peaks as lower bounds). The CUDA backend keeps host copies of the same results and a
// single-rank CPU reference, so the same model bounds its host memory too (not measured: no GPU here).
struct Footprint {
  int32_t pcp = 1;
  int64_t block_size = 64;
  int64_t q_lora_rank = 0;
  int64_t index_topk = 0;  // > 0 with --topk-fill on an indexer layer
  CacheFormat fmt;
  bool collect = false, staging = false;
  int64_t num_transports = 1;

  long double blocks = 1;  // the null block
  long double tokens = 0, max_local = 0, max_position = 0;

  std::string partial;  // when the count stopped early: which requests it covers

  /// Adds `count` requests like `r`.
  void add(const RequestSpec& r, long double count = 1) {
    const long double len = static_cast<long double>(r.context_len) + r.num_new_tokens;
    blocks += count * std::ceil(len / block_size);
    tokens += count * r.num_new_tokens;
    max_position = std::max(max_position, len);
    if (r.kind == RequestKind::kPrefill) {
      // DualChunkSwap: a rank holds at most two chunks of ceil(L / 2W) tokens.
      const long double chunk = std::ceil(static_cast<long double>(r.num_new_tokens) / (2.0L * pcp));
      max_local += count * std::min<long double>(r.num_new_tokens, 2 * chunk);
    } else {
      max_local += count;  // a decode sits on every rank
    }
  }
  long double slots() const { return blocks * block_size; }
  long double input_row_bytes() const {
    return 2.0L * (q_lora_rank + kKvLoraRank + kRopeDims + (fmt.has_indexer ? kIndexHeadDim : 0)) + 8;
  }
  // The backends lay out an indexer-K cache for every layer kind.
  long double replica_bytes() const {
    return slots() * static_cast<long double>(mla_row_bytes(fmt.kv_format) + kIndexerSlotBytes);
  }
  long double local_rows() const { return pcp * max_local; }  // W * M

  // Calls add(name, bytes) for each part of the estimate but the process baseline, margin included.
  template <class Add>
  void parts(Add&& add) const {
    constexpr long double kMargin = 1.10L;
    const long double W = pcp, M = max_local, N = tokens, q = q_lora_rank;
    const long double bf16_row = 2.0L * (kKvLoraRank + kRopeDims + (fmt.has_indexer ? kIndexHeadDim : 0));
    add("inputs", kMargin * N * input_row_bytes());
    add("per-rank input copies", kMargin * (local_rows() + N) * (input_row_bytes() + 8));
    add("cache replicas", kMargin * (W + static_cast<long double>(num_transports)) * replica_bytes());
    add("q_c outputs", kMargin * (local_rows() + N) * q * 2);
    add("top-k buffers", kMargin * local_rows() * index_topk * 4);
    if (collect) add("collect buffers", kMargin * (W * (W + 1) * M + 2 * N) * bf16_row);
    if (staging) add("staging buffers", kMargin * W * W * M * transport_row_layout(fmt).row_bytes);
    add("checks/plan/RoPE table",
        kMargin * (4 * M * q + slots() + 2 * (20 * N + 32 * W * M) + 8 * blocks + 256 * max_position));
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
  PCPKV_CHECK(f.blocks <= kMaxBlocks,
              "{}: the cache needs at least {:.0f} blocks of {} slots{}, more than the {} block ids an int32 block "
              "table holds",
              batch, static_cast<double>(f.blocks), f.block_size, f.partial, std::numeric_limits<int32_t>::max());
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
void check_save_target(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  PCPKV_CHECK(!fs::is_directory(path, ec), "--save: '{}' is a directory", path);
  const fs::file_status st = fs::status(path, ec);
  PCPKV_CHECK(!fs::exists(st) || fs::is_regular_file(st),
              "--save: '{}' exists and is not a regular file (a device, FIFO or socket); pcpkv replaces the file "
              "at that path, so it refuses",
              path);
  fs::path target;
  try {
    target = write_target(path);
  } catch (const Error& e) {
    throw Error(std::string("--save: ") + e.what(), e.where());
  }
  const fs::path dir = fs::absolute(target, ec).parent_path();
  PCPKV_CHECK(fs::exists(dir, ec), "--save: directory '{}' of '{}' does not exist", dir.string(), path);
  PCPKV_CHECK(fs::is_directory(dir, ec), "--save: '{}' (the directory of '{}') is not a directory", dir.string(),
              path);
  const std::string probe = fmt::format("{}.tmp.{}", target.string(), static_cast<long>(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  PCPKV_CHECK(fd >= 0, "--save: cannot create a file next to '{}' (tried '{}'): {}", path, probe,
              std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace

bool RunOutcome::ok() const {
  return !checks.empty() && std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.pass; });
}

std::vector<Transport> parse_transport_list(const std::string& s) {
  if (s == "all") return {Transport::kCollect, Transport::kStaging, Transport::kDirect};
  std::vector<Transport> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    PCPKV_CHECK(item == "collect" || item == "staging" || item == "direct",
                "--transport: unknown transport '{}' in '{}'; use all or a comma list of collect, staging, direct",
                item, s);
    const Transport t = parse_transport(item);
    PCPKV_CHECK(std::find(out.begin(), out.end(), t) == out.end(), "--transport: '{}' is listed twice in '{}'", item,
                s);
    out.push_back(t);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

PcpPlan single_rank_plan(const PcpPlan& plan) {
  PcpPlan s = plan;
  const int64_t n = plan.num_global_tokens();
  s.pcp_world = 1;
  s.max_local_tokens = n;
  RankPlan r;
  r.num_local_tokens = n;
  for (int64_t g = 0; g < n; ++g) {
    if (plan.requests[plan.global_request[g]].kind == RequestKind::kPrefill) {
      ++r.num_prefill_tokens;
    } else {
      ++r.num_decode_tokens;
    }
  }
  r.positions = plan.global_positions;
  r.slot_mapping = plan.global_slots;
  r.global_index.resize(static_cast<size_t>(n));
  std::iota(r.global_index.begin(), r.global_index.end(), int64_t{0});
  s.ranks = {std::move(r)};
  s.gathered_slot_mapping = plan.global_slots;
  validate_plan(s);
  return s;
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
  PCPKV_CHECK(o.decode_context >= -1,
              "--decode-context: must be >= -1 (-1: context 1000*(i+1)+7*i for decode i; >= 0: that context for "
              "every decode), got {}",
              o.decode_context);
  PCPKV_CHECK(std::isfinite(o.memory_limit_gb) && o.memory_limit_gb >= 0,
              "--memory-limit-gb: must be >= 0 (0: this machine's available memory), got {}", o.memory_limit_gb);
  PCPKV_CHECK(o.repeats >= 1, "--repeats: must be >= 1, got {}", o.repeats);
  PCPKV_CHECK(o.threads >= 0, "--threads: must be >= 0, got {}", o.threads);
  PCPKV_CHECK(o.threads <= 1024, "--threads: {} is more than pcpkv supports (1024)", o.threads);
  PCPKV_CHECK(o.inject_fault.empty() || o.inject_fault == "row" || o.inject_fault == "guard",
              "--inject-fault: must be row or guard, got '{}'", o.inject_fault);
  const std::string k_scale_typed = o.k_scale_text.empty() ? fmt::format("{}", o.k_scale) : o.k_scale_text;
  PCPKV_CHECK(std::isfinite(o.k_scale) && o.k_scale > 0, "--k-scale: must be positive and finite, got {}",
              k_scale_typed);
  // The cache stores k_scale as fp32: 1e-300 would round to 0 and 1e39 to inf, and later checks would
  // name the rounded value, not the one typed.
  PCPKV_CHECK(static_cast<float>(o.k_scale) > 0 && std::isfinite(static_cast<float>(o.k_scale)),
              "--k-scale: {} does not fit a float32 (the cache stores it as fp32: about 1.4e-45 to 3.4e38)",
              k_scale_typed);
  PCPKV_CHECK(o.layer == "indexer" || o.layer == "shared", "--layer: must be indexer or shared, got '{}'", o.layer);
  PCPKV_CHECK(o.backend == "auto" || o.backend == "cpu" || o.backend == "cuda",
              "--backend: unknown backend '{}'; known: auto, cpu, cuda", o.backend);
  p.fmt.kv_format = parse_kv_format(o.kv_format, "kv-format");
  p.fmt.ds_mla_scale = parse_ds_mla_scale(o.ds_mla_scale, "ds-mla-scale");
  p.fmt.k_scale = static_cast<float>(o.k_scale);
  p.fmt.has_indexer = o.layer == "indexer";
  p.transports = parse_transport_list(o.transport);
  // Flags that do not apply to this format or layer: say so rather than ignore them silently.
  auto given = [&](const char* flag) {
    return std::find(o.flags_given.begin(), o.flags_given.end(), flag) != o.flags_given.end();
  };
  if (!o.topk_fill.empty()) p.topk_fill = parse_topk_fill(o.topk_fill, "--topk-fill");
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
  InputsBatch batch;
  if (!o.inputs.empty()) {
    batch = read_inputs_batch(o.inputs);
    for (const std::string& n : batch.notes) p.notes_text.push_back(fmt::format("--inputs {}: {}", o.inputs, n));
    // Not an error: re-encoding saved activations in another format is a use; the saved caches are not read.
    if (!batch.saved_kv_format.empty() && batch.saved_kv_format != to_string(p.fmt.kv_format)) {
      p.notes_text.push_back(fmt::format(
          "--inputs {}: saved with kv_format {}, this run publishes {}: the caches are computed anew from the "
          "file's activations, so they (and a --save of this run) differ from the file's mla_cache",
          o.inputs, batch.saved_kv_format, to_string(p.fmt.kv_format)));
    }
  }
  Footprint fp;
  fp.pcp = o.pcp;
  fp.block_size = o.block_size;
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
              o.inputs, batch.block_tables.empty() ? "slot_mapping" : "block_tables", batch.saved_block_size,
              o.block_size, batch.saved_block_size);
  if (!batch.requests.empty()) {
    int64_t max_context = 0;
    for (const RequestSpec& r : batch.requests) {
      fp.add(r);
      max_context = std::max(max_context, r.context_len);
    }
    std::tie(p.memory_estimate, p.memory_limit) =
        check_footprint(fp,
                        fmt::format("--inputs {} ({} requests, {} tokens, contexts up to {}) with {}", o.inputs,
                                    batch.requests.size(), batch.num_tokens, max_context, geometry),
                        o.memory_limit_gb, /*from_file=*/true);
    pc.requests = batch.requests;
    p.batch_source = fmt::format("{} requests from {}", batch.requests.size(), o.inputs);
    p.notes_text.push_back(
        fmt::format("batch: {} describes its requests; --tokens, --decodes and --decode-context are not used",
                    o.inputs));
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
            (fp.blocks > std::numeric_limits<int32_t>::max() || fp.model_bytes() > memory)) {
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
                  o.inputs, batch.num_tokens, p.batch_source, n);
    }
  }
  p.plan = make_plan(pc);
  validate_positions(p.plan, p.model.max_position_embeddings,
                     fmt::format("{} (model {})", p.batch_source, p.model.name));
  // The file's block tables and slots replace the fresh plan's, so a run loaded from a file (and its --save)
  // keeps tables and slots that agree: slot = table[pos / B] * B + pos % B.
  const std::string origin = "--inputs " + o.inputs;
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
    p.notes_text.push_back(fmt::format("slots: taken from {} (block_tables{})", o.inputs,
                                       batch.slot_mapping.empty() ? "" : "; slot_mapping agrees"));
  } else if (!batch.slot_mapping.empty()) {
    apply_slot_mapping(p.plan, batch.slot_mapping, origin);
    validate_plan(p.plan);
    p.notes_text.push_back(
        fmt::format("slots: taken from {} (slot_mapping); the block tables follow from them", o.inputs));
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

    step(progress, fmt::format("verifying {}: replicas", name));
    out.checks.push_back(check_replicas(run.result, prep.fmt, prep.plan.pcp_world));
    step(progress, fmt::format("verifying {}: single-rank reference", name));
    out.checks.push_back(check_reference(run, prep));
    step(progress, fmt::format("verifying {}: guard bytes", name));
    out.checks.push_back(check_guards(run.result, prep));
    step(progress, fmt::format("verifying {}: dequantized cache vs fp64", name));
    out.checks.push_back(check_bound(run.result, prep));
    if (topk_width > 0) out.checks.push_back(check_topk(run.result, prep, topk_width));

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
    out.checks.push_back(check_same_cache(staging->result, direct->result, prep.fmt, "staging == direct", ""));
  }
  // Saturated values are not held to the bound: when many saturate, a PASS says little about them.
  std::string saturated;
  double worst_fraction = 0;
  for (const Check& c : out.checks) {
    if (c.num_values <= 0 || c.num_saturated * 100 <= c.num_values) continue;  // <= 1%
    const double fraction = static_cast<double>(c.num_saturated) / static_cast<double>(c.num_values);
    worst_fraction = std::max(worst_fraction, fraction);
    saturated +=
        fmt::format("{}{} {} of {}", saturated.empty() ? "" : ", ", c.transport, c.num_saturated, c.num_values);
  }
  if (!saturated.empty()) {
    out.notes.push_back(fmt::format(
        "fp8 bound: up to {:.1f}% of the checked values saturate at 448 * k_scale ({}); saturated values are "
        "not held to the bound, so the bound check is weak here (--k-scale {} is small for these inputs)",
        100.0 * worst_fraction, saturated, prep.fmt.k_scale));
  }
  // The other end: values below the smallest E4M3 step encode as 0 and meet the bound through its absolute
  // term (2^-10 * k_scale), which a huge scale makes large.
  std::string flushed;
  double worst_flushed = 0;
  for (const Check& c : out.checks) {
    if (c.num_values <= 0 || c.num_flushed * 100 <= c.num_values) continue;  // <= 1%
    const double fraction = static_cast<double>(c.num_flushed) / static_cast<double>(c.num_values);
    worst_flushed = std::max(worst_flushed, fraction);
    flushed += fmt::format("{}{} {} of {}", flushed.empty() ? "" : ", ", c.transport, c.num_flushed, c.num_values);
  }
  if (!flushed.empty()) {
    out.notes.push_back(fmt::format(
        "fp8 bound: up to {:.1f}% of the checked values lie below 2^-10 * k_scale and encode as 0 ({}); the "
        "bound's absolute term lets them pass, so the bound check is weak here (--k-scale {} is large for these "
        "inputs)",
        100.0 * worst_flushed, flushed, prep.fmt.k_scale));
  }
  return out;
}

}  // namespace pcpkv::cli
