// The publication checks (pcpkv/publish/checks.h, the Check half): byte comparisons whose first difference
// names its place in the cache, the guard and bound checks over every rank, and the set `pcpkv run` applies.
#include <algorithm>
#include <functional>
#include <numeric>
#include <utility>

#include <fmt/format.h>

#include "pcpkv/core/error.h"
#include "core/fnv1a.h"
#include "pcpkv/publish/checks.h"
#include "pcpkv/publish/replica_hash.h"

namespace pcpkv {
namespace {

Check make_check(std::string name, std::string transport) {
  Check c;
  c.name = std::move(name);
  c.transport = std::move(transport);
  return c;
}

std::string mb(int64_t bytes) { return fmt::format("{:.1f} MB", static_cast<double>(bytes) / 1e6); }

std::string rank_name(const std::vector<int32_t>& names, int32_t q) {
  return names.empty() ? fmt::format("rank {}", q) : fmt::format("global rank {}", names[static_cast<size_t>(q)]);
}

// Accumulates byte comparisons into one check; the first difference names its place and both byte values.
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
      const auto i = static_cast<size_t>(d.first_diff);
      first = fmt::format("{}: {} bytes differ, first at {}: 0x{:02x} vs 0x{:02x}", label, d.num_diff,
                          where(d.first_diff), a[i], b[i]);
    }
  }
  void fill(Check& c, const std::string& ok_detail) const {
    c.num_bytes = bytes;
    c.num_diff = diff;
    c.pass = diff == 0;
    c.detail = c.pass ? ok_detail : first;
  }
};

std::function<std::string(int64_t)> mla_where(const PublishResult& r, const CacheFormat& fmt) {
  return [&r, fmt](int64_t o) { return describe_mla_byte(r, fmt, o); };
}
std::function<std::string(int64_t)> index_where(const PublishResult& r) {
  return [&r](int64_t o) { return describe_index_byte(r, o); };
}

template <class T>
std::vector<uint8_t> as_bytes(const T* p, int64_t n) {
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n * static_cast<int64_t>(sizeof(T)));
}

void check_ranks(const PublishResult& r, size_t world, const char* what) {
  PCPKV_CHECK(r.mla_alloc.size() >= world && r.index_alloc.size() >= world,
              "{}: the result holds {} MLA / {} indexer allocations, {} needed", what, r.mla_alloc.size(),
              r.index_alloc.size(), world);
}

}  // namespace

PcpPlan single_rank_plan(const PcpPlan& plan) {
  PcpPlan s = plan;
  const int64_t n = plan.num_global_tokens();
  s.pcp_world = 1;
  s.max_local_tokens = n;
  s.local_order = LocalOrder::kRequest;  // global order on the one rank, which writes every decode
  s.decode_ownership = DecodeOwnership::kReplicated;
  for (int32_t& o : s.decode_owner) o = o >= 0 ? 0 : -1;
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

bool all_pass(const std::vector<Check>& checks) {
  return !checks.empty() && std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.pass; });
}

Check check_replicas_identical(const PublishResult& r, const CacheFormat& fmt) {
  const auto world = static_cast<int32_t>(r.mla_alloc.size());
  check_ranks(r, std::max<size_t>(1, r.mla_alloc.size()), "check_replicas_identical");
  Check c = make_check("replicas identical", to_string(r.transport));
  ByteTally t;
  for (int32_t rank = 1; rank < world; ++rank) {
    t.add(r.mla_alloc[rank], r.mla_alloc[0], fmt::format("rank {} MLA vs rank 0", rank), mla_where(r, fmt));
    // A layer without an indexer: its guard-only allocation must be identical too (whole allocations).
    t.add(r.index_alloc[rank], r.index_alloc[0], fmt::format("rank {} indexer vs rank 0", rank), index_where(r));
  }
  std::string ok = fmt::format("{} replicas x (MLA {}{}) byte-identical", world, mb(r.mla_alloc[0].size()),
                               fmt.has_indexer ? " + indexer " + mb(r.index_alloc[0].size()) : "");
  if (world == 1) ok = "1 replica (PCP 1): nothing to compare";
  t.fill(c, ok);
  return c;
}

Check check_same_caches(const PublishResult& a, const PublishResult& b, const CacheFormat& fmt, std::string name,
                        std::string transport) {
  check_ranks(a, 1, "check_same_caches");
  check_ranks(b, 1, "check_same_caches");
  Check c = make_check(std::move(name), std::move(transport));
  ByteTally t;
  t.add(a.mla_alloc[0], b.mla_alloc[0], "MLA cache", mla_where(a, fmt));
  t.add(a.index_alloc[0], b.index_alloc[0], "indexer cache", index_where(a));
  t.fill(c, fmt::format("MLA {}{} byte-identical", mb(a.mla_alloc[0].size()),
                        fmt.has_indexer ? " + indexer " + mb(a.index_alloc[0].size()) : ""));
  return c;
}

Check check_vs_single_rank(const PublishResult& r, const PublishResult& ref, const PcpPlan& plan,
                           const CacheFormat& fmt, int64_t q) {
  check_ranks(r, 1, "check_vs_single_rank");
  check_ranks(ref, 1, "check_vs_single_rank");
  Check c = make_check("== single-rank reference", to_string(r.transport));
  ByteTally t;
  t.add(r.mla_alloc[0], ref.mla_alloc[0], "rank 0 MLA vs PCP-1", mla_where(r, fmt));
  t.add(r.index_alloc[0], ref.index_alloc[0], "rank 0 indexer vs PCP-1", index_where(r));
  std::string q_note;
  if (!r.q_c_out.empty() && !ref.q_c_out.empty()) {
    PCPKV_CHECK(static_cast<int32_t>(r.q_c_out.size()) >= plan.pcp_world,
                "check_vs_single_rank: q_c_out of {} ranks, the plan has {}", r.q_c_out.size(), plan.pcp_world);
    for (int32_t rank = 0; rank < plan.pcp_world; ++rank) {
      const RankPlan& rp = plan.ranks[rank];
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

Check check_replicas_vs_reference(const PublishResult& got, const PublishResult& ref, const CacheFormat& fmt,
                                  const std::vector<int32_t>& rank_names) {
  const size_t world = got.mla_alloc.size();
  check_ranks(got, world, "check_replicas_vs_reference");
  check_ranks(ref, world, "check_replicas_vs_reference");
  PCPKV_CHECK(ref.mla_alloc.size() == world, "check_replicas_vs_reference: {} replicas, the reference has {}", world,
              ref.mla_alloc.size());
  PCPKV_CHECK(rank_names.empty() || rank_names.size() >= world,
              "check_replicas_vs_reference: {} rank names for {} ranks", rank_names.size(), world);
  Check c = make_check("replicas == single-process CPU reference", to_string(got.transport));
  ByteTally t;
  for (size_t q = 0; q < world; ++q) {
    const std::string who = rank_name(rank_names, static_cast<int32_t>(q));
    t.add(got.mla_alloc[q], ref.mla_alloc[q], who + "'s MLA replica", mla_where(got, fmt));
    t.add(got.index_alloc[q], ref.index_alloc[q], who + "'s indexer replica", index_where(got));
  }
  t.fill(c, fmt::format("{} replicas, {} bytes compared", world, t.bytes));
  return c;
}

Check check_guards(const PublishResult& r, const PcpPlan& plan, const CacheFormat& fmt,
                   const std::vector<int32_t>& rank_names) {
  check_ranks(r, static_cast<size_t>(plan.pcp_world), "check_guards");
  Check c = make_check("guard/untouched bytes intact", to_string(r.transport));
  int64_t bad = 0, total = 0;
  std::string first;
  for (int32_t rank = 0; rank < plan.pcp_world; ++rank) {
    const GuardReport g = check_untouched(r, rank, plan, fmt);
    bad += g.num_bad;
    total += static_cast<int64_t>(r.mla_alloc[rank].size() + r.index_alloc[rank].size());
    if (g.num_bad && first.empty())
      first = fmt::format("{}: {} bytes changed; first: {}", rank_name(rank_names, rank), g.num_bad, g.first);
  }
  c.num_bytes = total;
  c.num_diff = bad;
  c.pass = bad == 0;
  c.detail = c.pass ? fmt::format("every byte outside written rows is 0x{:02X} on all {} ranks", kGuardByte,
                                  plan.pcp_world)
                    : first;
  return c;
}

Check check_outputs_vs_reference(const std::vector<uint16_t>& q_c_out, const std::vector<int32_t>& topk,
                                 const PublishResult& ref, int32_t rank) {
  Check c = make_check(fmt::format("rank {} q_c_out / top-k == reference", rank), to_string(ref.transport));
  ByteTally t;
  auto pick = [&](const auto& all, const char* what) {
    PCPKV_CHECK(rank >= 0 && rank < static_cast<int32_t>(all.size()),
                "check_outputs_vs_reference: the reference has {} for {} ranks, rank {} asked", what, all.size(), rank);
    return all[static_cast<size_t>(rank)];
  };
  if (!q_c_out.empty()) {
    const auto want = pick(ref.q_c_out, "q_c_out");
    t.add(as_bytes(q_c_out.data(), static_cast<int64_t>(q_c_out.size())),
          as_bytes(want.data(), static_cast<int64_t>(want.size())), fmt::format("rank {} q_c_out", rank),
          [](int64_t o) { return fmt::format("byte {}", o); });
  }
  if (!topk.empty()) {
    const auto want = pick(ref.topk, "top-k");
    t.add(as_bytes(topk.data(), static_cast<int64_t>(topk.size())),
          as_bytes(want.data(), static_cast<int64_t>(want.size())), fmt::format("rank {} top-k", rank),
          [](int64_t o) { return fmt::format("entry {}", o / 4); });
  }
  t.fill(c, t.bytes == 0 ? std::string("nothing to compare (no q_c_out, no top-k)")
                         : fmt::format("{} bytes identical", t.bytes));
  return c;
}

Check check_fence_epochs(const std::vector<uint64_t>& e0, const std::vector<uint64_t>& e1, int32_t replays) {
  Check c = make_check("fence epochs advanced every replay", "");
  const uint64_t runs = static_cast<uint64_t>(replays) + 1;  // + the eager run before the capture
  c.pass = e1.size() == e0.size() && e1.size() >= 1 && e1[0] == e0[0] + runs &&
           (e1.size() < 2 || e1[1] == e0[1] || e1[1] == e0[1] + runs);
  c.detail = fmt::format("start-fence epoch {} -> {}, publication-fence epoch {} -> {} over {} replays",
                         e0.empty() ? 0 : e0[0], e1.empty() ? 0 : e1[0], e0.size() > 1 ? e0[1] : 0,
                         e1.size() > 1 ? e1[1] : 0, replays);
  return c;
}

uint64_t replicas_fingerprint(const PublishResult& r) {
  uint64_t h = 0;
  for (size_t q = 0; q < r.mla_alloc.size(); ++q) {
    // Seeded per rank from the previous hash, so a rank's bytes moved to another rank change it.
    h = fnv1a(r.mla_alloc[q].data(), r.mla_alloc[q].size(), h ^ 0x9e37u);
    if (q < r.index_alloc.size()) h = fnv1a(r.index_alloc[q].data(), r.index_alloc[q].size(), h);
  }
  return h;
}

Check check_same_fingerprint(std::string name, uint64_t a, uint64_t b) {
  Check c = make_check(std::move(name), "");
  c.pass = a == b;
  c.detail = c.pass ? fmt::format("every replica, FNV-64 {:016x}", b)
                    : fmt::format("every replica, FNV-64 {:016x} vs {:016x}", a, b);
  return c;
}

Check check_bound(const PublishResult& r, const GlobalInputs& in, const PcpPlan& plan, const ModelConfig& model,
                  const CacheFormat& fmt) {
  const bool collect = r.transport == Transport::kCollect;
  const char* what = fmt.kv_format != KvFormat::kBf16 ? "FP8" : (fmt.has_indexer ? "bf16 / FP8" : "bf16");
  Check c = make_check(fmt::format("dequantized vs fp64 within the {} bound", what), to_string(r.transport));
  const Fp8Report f = check_fp8_bound(r, 0, in, plan, model, fmt, collect);
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

Check check_topk_filled(const PublishResult& r, const PcpPlan& plan, int64_t width, TopkFill mode) {
  const char* what = mode == TopkFill::kFull   ? "top-k buffer filled with -1 (full)"
                     : mode == TopkFill::kTail ? "top-k buffer: padding rows -1, local tokens' rows untouched (tail)"
                                               : "top-k buffer untouched (none)";
  Check c = make_check(what, to_string(r.transport));
  ByteTally t;
  const int64_t M = plan.max_local_tokens;
  for (int32_t rank = 0; rank < plan.pcp_world && rank < static_cast<int32_t>(r.topk.size()); ++rank) {
    const int64_t n = M * width;
    const int64_t first = topk_fill_first_row(mode, plan.ranks[rank].num_local_tokens, M);
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
  t.fill(c, fmt::format("{} int32 per row, {} rows per rank", width, M));
  return c;
}

std::vector<Check> check_publication(const PublishResult& result, const PublishResult& single_rank,
                                     const PublicationCase& pc, const std::function<void(const std::string&)>& step) {
  PCPKV_CHECK(pc.model && pc.plan && pc.inputs, "check_publication: model, plan and inputs must be set");
  auto say = [&](const char* what) {
    if (step) step(what);
  };
  std::vector<Check> out;
  say("replicas");
  out.push_back(check_replicas_identical(result, pc.fmt));
  say("single-rank reference");
  out.push_back(check_vs_single_rank(result, single_rank, *pc.plan, pc.fmt, pc.model->q_lora_rank));
  say("guard bytes");
  out.push_back(check_guards(result, *pc.plan, pc.fmt));
  say("dequantized cache vs fp64");
  out.push_back(check_bound(result, *pc.inputs, *pc.plan, *pc.model, pc.fmt));
  if (pc.topk_width > 0) out.push_back(check_topk_filled(result, *pc.plan, pc.topk_width, pc.topk_fill));
  if (pc.check_replicas) {
    say("replica hashes");
    out.push_back(check_replica_hashes(result, *pc.plan, pc.fmt, pc.layer_idx));
  }
  return out;
}

std::vector<std::string> check_notes(const std::vector<Check>& checks, float k_scale) {
  std::vector<std::string> notes;
  // A count over 1% of a bound check's values, as "collect 123 of 4567, direct ..." and the worst fraction.
  auto over = [&](int64_t Check::*count, double* worst) {
    std::string list;
    for (const Check& c : checks) {
      if (c.num_values <= 0 || c.*count * 100 <= c.num_values) continue;
      *worst = std::max(*worst, static_cast<double>(c.*count) / static_cast<double>(c.num_values));
      list += fmt::format("{}{} {} of {}", list.empty() ? "" : ", ", c.transport, c.*count, c.num_values);
    }
    return list;
  };
  // Saturated values are not held to the bound: when many saturate, a PASS says little about them.
  double worst = 0;
  const std::string saturated = over(&Check::num_saturated, &worst);
  if (!saturated.empty()) {
    notes.push_back(fmt::format(
        "fp8 bound: up to {:.1f}% of the checked values saturate at 448 * k_scale ({}); saturated values are "
        "not held to the bound, so the bound check is weak here (--k-scale {} is small for these inputs)",
        100.0 * worst, saturated, k_scale));
  }
  // The other end: values below the smallest E4M3 step encode as 0 and meet the bound through its absolute
  // term (2^-10 * k_scale), which a huge scale makes large.
  worst = 0;
  const std::string flushed = over(&Check::num_flushed, &worst);
  if (!flushed.empty()) {
    notes.push_back(fmt::format(
        "fp8 bound: up to {:.1f}% of the checked values lie below 2^-10 * k_scale and encode as 0 ({}); the "
        "bound's absolute term lets them pass, so the bound check is weak here (--k-scale {} is large for these "
        "inputs)",
        100.0 * worst, flushed, k_scale));
  }
  return notes;
}

}  // namespace pcpkv
