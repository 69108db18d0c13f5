// The main job of `pcpkv run` (issue 2 part 4): prepare (validate everything, write nothing), publish
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

#include "pcpkv/error.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/inputs_io.h"
#include "pcpkv/safetensors.h"
#include "pcpkv/verify.h"
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

Check check_topk(const PublishResult& r, const PreparedRun& prep, int64_t width) {
  Check c = make_check("top-k buffer filled with -1", to_string(r.transport));
  ByteTally t;
  for (int32_t rank = 0; rank < prep.plan.pcp_world && rank < static_cast<int32_t>(r.topk.size()); ++rank) {
    const int64_t n = prep.plan.ranks[rank].num_local_tokens * width;
    const auto* p = reinterpret_cast<const uint8_t*>(r.topk[rank].data());
    std::vector<uint8_t> got(p, p + std::min<int64_t>(n, static_cast<int64_t>(r.topk[rank].size())) * 4);
    std::vector<uint8_t> want(static_cast<size_t>(n * 4), 0xFF);
    t.add(got, want, fmt::format("rank {} top-k", rank),
          [&](int64_t o) { return fmt::format("token {}, entry {}", o / (4 * width), (o % (4 * width)) / 4); });
  }
  if (r.topk.empty()) {
    c.detail = "the backend returned no top-k buffer";
    return c;
  }
  t.fill(c, fmt::format("{} int32 per local token on all ranks", width));
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

std::string size_text(long double bytes) {
  if (bytes >= 1e12L) return fmt::format("{:.1f} TB", static_cast<double>(bytes / 1e12L));
  if (bytes >= 1e9L) return fmt::format("{:.1f} GB", static_cast<double>(bytes / 1e9L));
  return fmt::format("{:.1f} MB", static_cast<double>(bytes / 1e6L));
}

// Memory this process may use: physical RAM, or the cgroup limit when lower (a container's OOM killer
// would end the run with no message).
long double host_memory_bytes() {
  long double m = std::numeric_limits<long double>::infinity();
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) m = static_cast<long double>(pages) * page;
  for (const char* f : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(f);
    long double v = 0;
    if (in >> v && v > 0) m = std::min(m, v);  // "max" (no limit) does not parse
  }
  return m;
}

// A lower bound of what a run holds at once, added up request by request before the plan exists (the
// plan itself would allocate per token and per block): the inputs, every rank's cache replica, the
// materialized q_c rows and, for staging, every rank's staging buffer. In long double: flags like
// --tokens 99999999999 must give a message, not an overflow.
struct Footprint {
  int32_t pcp = 1;
  int64_t block_size = 64;
  int64_t q_lora_rank = 0;
  CacheFormat fmt;
  bool staging = false;

  long double blocks = 1;  // the null block
  long double tokens = 0, prefill_tokens = 0, decodes = 0;

  std::string partial;  // when the count stopped early: which requests it covers

  /// Adds `count` requests like `r`.
  void add(const RequestSpec& r, long double count = 1) {
    blocks += count * std::ceil((static_cast<long double>(r.context_len) + r.num_new_tokens) / block_size);
    tokens += count * r.num_new_tokens;
    if (r.kind == RequestKind::kPrefill) {
      prefill_tokens += count * r.num_new_tokens;
    } else {
      decodes += count;
    }
  }
  long double inputs_bytes() const {
    return tokens * (2.0L * (q_lora_rank + kKvLoraRank + kRopeDims + (fmt.has_indexer ? kIndexHeadDim : 0)) + 8);
  }
  // The backends lay out an indexer-K cache for every layer kind.
  long double replica_bytes() const {
    return blocks * block_size * static_cast<long double>(mla_row_bytes(fmt.kv_format) + kIndexerSlotBytes);
  }
  long double max_local_tokens() const { return std::ceil(prefill_tokens / pcp) + decodes; }
  long double q_out_bytes() const { return pcp * max_local_tokens() * q_lora_rank * 2.0L; }
  long double staging_bytes() const {
    return staging ? pcp * 2.0L * pcp * max_local_tokens() * transport_row_layout(fmt).row_bytes : 0.0L;
  }
  long double bytes() const { return inputs_bytes() + pcp * replica_bytes() + q_out_bytes() + staging_bytes(); }
};

// Refuses a batch whose block ids overflow the int32 block tables or whose footprint exceeds this
// machine's memory. `batch` names the flags (or the file) the batch came from.
void check_footprint(const Footprint& f, const std::string& batch) {
  constexpr auto kMaxBlocks = static_cast<long double>(std::numeric_limits<int32_t>::max());
  PCPKV_CHECK(f.blocks <= kMaxBlocks,
              "{}: the cache needs at least {:.0f} blocks of {} slots{}, more than the {} block ids an int32 block "
              "table holds",
              batch, static_cast<double>(f.blocks), f.block_size, f.partial, std::numeric_limits<int32_t>::max());
  const long double need = f.bytes(), have = host_memory_bytes();
  PCPKV_CHECK(need <= have,
              "{}: the run needs at least {} of memory{} (inputs {}, {} cache replica{} of {}{}), more than the {} "
              "of this machine",
              batch, size_text(need), f.partial, size_text(f.inputs_bytes()), f.pcp, f.pcp == 1 ? "" : "s",
              size_text(f.replica_bytes()), f.staging ? ", staging buffers " + size_text(f.staging_bytes()) : "",
              size_text(have));
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

void check_read_path(const char* flag, const std::string& path, bool regular_only) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  PCPKV_CHECK(fs::exists(st), "{}: no such file '{}'", flag, path);
  PCPKV_CHECK(!fs::is_directory(st), "{}: '{}' is a directory", flag, path);
  PCPKV_CHECK(!regular_only || fs::is_regular_file(st),
              "{}: '{}' is not a regular file (pcpkv seeks in it; copy it to a file first)", flag, path);
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
  PCPKV_CHECK(o.decode_context >= -1, "--decode-context: must be >= 0, got {}", o.decode_context);
  PCPKV_CHECK(o.repeats >= 1, "--repeats: must be >= 1, got {}", o.repeats);
  PCPKV_CHECK(o.threads >= 0, "--threads: must be >= 0, got {}", o.threads);
  PCPKV_CHECK(o.threads <= 1024, "--threads: {} is more than pcpkv supports (1024)", o.threads);
  PCPKV_CHECK(o.inject_fault.empty() || o.inject_fault == "row" || o.inject_fault == "guard",
              "--inject-fault: must be row or guard, got '{}'", o.inject_fault);
  PCPKV_CHECK(std::isfinite(o.k_scale) && o.k_scale > 0, "--k-scale: must be positive and finite, got {}", o.k_scale);
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
  if (!o.inputs.empty()) check_read_path("--inputs", o.inputs, /*regular_only=*/true);
  // A config may come through a pipe (--config <(...)): only a directory is refused here.
  if (!o.config.empty()) check_read_path("--config", o.config, /*regular_only=*/false);
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
  if (!o.inputs.empty()) batch = read_inputs_batch(o.inputs);
  Footprint fp;
  fp.pcp = o.pcp;
  fp.block_size = o.block_size;
  fp.q_lora_rank = p.model.q_lora_rank;
  fp.fmt = p.fmt;
  fp.staging = std::find(p.transports.begin(), p.transports.end(), Transport::kStaging) != p.transports.end();
  const std::string geometry = fmt::format("--pcp {} --block-size {}", o.pcp, o.block_size);
  if (!batch.requests.empty()) {
    int64_t max_context = 0;
    for (const RequestSpec& r : batch.requests) {
      fp.add(r);
      max_context = std::max(max_context, r.context_len);
    }
    check_footprint(fp, fmt::format("--inputs {} ({} requests, {} tokens, contexts up to {}) with {}", o.inputs,
                                    batch.requests.size(), batch.num_tokens, max_context, geometry));
    pc.requests = batch.requests;
    p.batch_source = fmt::format("{} requests from {}", batch.requests.size(), o.inputs);
    p.notes_text.push_back(
        fmt::format("batch: {} describes its requests; --tokens and --decodes are not used", o.inputs));
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
      // Contexts differ per decode: count them one by one, but stop once over (the loop stays short).
      const long double memory = host_memory_bytes();
      for (int32_t i = 0; i < o.decodes; ++i) {
        fp.add(decode(i));
        if (i + 1 < o.decodes && (fp.blocks > std::numeric_limits<int32_t>::max() || fp.bytes() > memory)) {
          fp.partial = fmt::format(" (counting only the first {} of the {} decodes)", i + 1, o.decodes);
          break;
        }
      }
    }
    check_footprint(fp, flags);
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
  if (!batch.slot_mapping.empty()) {
    apply_slot_mapping(p.plan, batch.slot_mapping, "--inputs " + o.inputs);
    validate_plan(p.plan);
    p.notes_text.push_back(fmt::format("slots: taken from {} (slot_mapping)", o.inputs));
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

  const int64_t topk_width = prep.opts.topk_fill && prep.fmt.has_indexer ? prep.model.index_topk : 0;
  PublishSetup setup;
  setup.model = &prep.model;
  setup.plan = &prep.plan;
  setup.fmt = prep.fmt;
  setup.topk_width = topk_width;
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
  return out;
}

}  // namespace pcpkv::cli
