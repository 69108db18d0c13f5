// `pcpkv bench-allreduce`: pcpkv's symmetric-memory all-reduce (one-shot, two-shot, fused residual-add +
// RMSNorm) against ncclAllReduce across rank processes, one GPU each. Run it as
//   pcpkv launch --nproc N --gpus 0,1,.. -- bench-allreduce
// Rank 0 prints per message size the latency of each variant (per rank the median over graph replays, then
// the slowest rank), the fastest variant, what the dispatch table (choose_allreduce_algo) picks today, and
// the crossover sizes: one-shot -> two-shot, and symmetric memory -> NCCL.
//
// Exit code: 0, or 1 when a symmetric variant's bytes differ from the CPU oracle; 2 bad input; 4 a peer failed.
#include <algorithm>
#include <cstdio>
#include <map>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "launch_cmds.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/serving/allreduce.h"
#include "pcpkv/core/error.h"
#include "pcpkv_bench/allreduce.h"
#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/publish/cuda_multiproc.h"
#endif

namespace pcpkv::cli {
namespace {

struct BenchAllReduceFlags {
  std::vector<int64_t> bytes;
  int64_t hidden = 6144;
  int32_t repeats = 7;
  bool no_check = false;
  bool md_rows = false;
};

[[maybe_unused]] std::string size_text(int64_t b) {  // used by the CUDA build only
  if (b >= (int64_t{1} << 20) && b % (int64_t{1} << 20) == 0) return fmt::format("{} MiB", b >> 20);
  if (b >= 1024 && b % 1024 == 0) return fmt::format("{} KiB", b >> 10);
  return fmt::format("{} B", b);
}

// What every rank must share: the sizes, row length and replays decide every collective (--md-rows is rank 0's).
std::vector<std::pair<std::string, std::string>> agreed_fields(const BenchAllReduceFlags& f) {
  return {{"--bytes", f.bytes.empty() ? std::string("(default)") : fmt::format("{}", fmt::join(f.bytes, ","))},
          {"--hidden", fmt::format("{}", f.hidden)},
          {"--repeats", fmt::format("{}", f.repeats)},
          {"--no-check", f.no_check ? "on" : "off"}};
}

#if defined(PCPKV_HAVE_CUDA)
int bench_allreduce(const BenchAllReduceFlags& f, Bootstrap& world) {
  cuda::AllReduceSweepOptions o;
  o.bytes = f.bytes;
  o.hidden = f.hidden;
  o.repeats = f.repeats;
  o.check = !f.no_check;
  const cuda::AllReduceSweepResult r = cuda::bench_allreduce_sweep(world, o);
  bool ok = true;
  for (const auto& row : r.rows)
    if (row.variant != "nccl" && row.variant != "nccl-fused" && row.mismatches > 0) ok = false;
  if (world.rank() != 0) return ok ? 0 : 1;

  const int32_t W = r.world_size;
  std::string text = fmt::format(
      "pcpkv bench-allreduce: {} processes, {}; bf16; us per call = max over ranks of each rank's median over {} "
      "graph replays; oracle = byte-exact CPU reference ({}){}\n",
      W, r.device, f.repeats, o.check ? "checked" : "not checked",
      r.symmetric ? "" : fmt::format("\n  symmetric memory REFUSED: {} (only NCCL ran)", r.fallback_reason));
  // Tables: plain by size, fused by rows; columns = variants.
  std::map<int64_t, std::map<std::string, const cuda::AllReduceSweepRow*>> plain, fused;
  for (const auto& row : r.rows) {
    const bool is_fused = row.variant.find("fused") != std::string::npos;
    (is_fused ? fused : plain)[row.bytes][row.variant] = &row;
  }
  auto us = [](const std::map<std::string, const cuda::AllReduceSweepRow*>& m, const std::string& v) {
    auto it = m.find(v);
    return it == m.end() ? -1.0 : it->second->us;
  };
  auto oracle = [&](const std::map<std::string, const cuda::AllReduceSweepRow*>& m) {
    int64_t bad = 0;
    bool checked = false;
    std::string nccl_note;
    for (const auto& [v, row] : m) {
      if (row->mismatches < 0) continue;
      checked = true;
      if (v.rfind("nccl", 0) == 0)
        nccl_note = fmt::format("; NCCL {} elems differ", row->mismatches);
      else
        bad += row->mismatches;
    }
    if (!checked) return std::string("not checked");
    return std::string(bad == 0 ? "PASS" : fmt::format("FAIL ({} elems)", bad)) + nccl_note;
  };
  int64_t one_to_two = -1, sym_to_nccl = -1, fused_one_to_two = -1, fused_sym_to_nccl = -1;
  text += fmt::format("  {:>9}  {:>10} {:>10} {:>10}   {:<8} {:<8}  {}\n", "size", "one-shot", "two-shot", "NCCL", "best",
                      "table", "oracle");
  std::string md;
  for (const auto& [bytes, m] : plain) {
    const double a = us(m, "oneshot"), b = us(m, "twoshot"), c = us(m, "nccl");
    std::string best = "nccl";
    double best_us = c;
    if (a > 0 && a < best_us) best = "oneshot", best_us = a;
    if (b > 0 && b < best_us) best = "twoshot", best_us = b;
    if (one_to_two < 0 && a > 0 && b > 0 && b < a) one_to_two = bytes;
    if (sym_to_nccl < 0 && a > 0 && b > 0 && c < std::min(a, b)) sym_to_nccl = bytes;
    const std::string table = to_string(choose_allreduce_algo(bytes, W));
    text += fmt::format("  {:>9}  {:>10.2f} {:>10.2f} {:>10.2f}   {:<8} {:<8}  {}\n", size_text(bytes), a, b, c, best,
                        table, oracle(m));
    md += fmt::format("md|| {} | {} | {:.2f} | {:.2f} | {:.2f} | {} | {} | {} |\n", W, size_text(bytes), a, b, c, best,
                      table, oracle(m));
  }
  text += fmt::format("  crossover one-shot -> two-shot: {}; symmetric memory -> NCCL: {}\n",
                      one_to_two < 0 ? "none in range" : "at " + size_text(one_to_two),
                      sym_to_nccl < 0 ? "none in range (symmetric memory wins everywhere)" : "at " + size_text(sym_to_nccl));
  text += fmt::format("  fused all-reduce + residual add + RMSNorm, rows of {} (NCCL: ncclAllReduce + the add+RMSNorm kernel)\n",
                      f.hidden);
  text += fmt::format("  {:>6} {:>9}  {:>10} {:>10} {:>10}   {:<14} {:<8}  {}\n", "rows", "size", "one-shot",
                      "two-shot", "NCCL+norm", "best", "table", "oracle");
  for (const auto& [bytes, m] : fused) {
    const double a = us(m, "fused-oneshot"), b = us(m, "fused-twoshot"), c = us(m, "nccl-fused");
    std::string best = "nccl+norm";
    double best_us = c;
    if (a > 0 && a < best_us) best = "fused-oneshot", best_us = a;
    if (b > 0 && b < best_us) best = "fused-twoshot", best_us = b;
    const int64_t rows = bytes / (2 * f.hidden);
    if (fused_one_to_two < 0 && a > 0 && b > 0 && b < a) fused_one_to_two = bytes;
    if (fused_sym_to_nccl < 0 && a > 0 && b > 0 && c < std::min(a, b)) fused_sym_to_nccl = bytes;
    const std::string table = to_string(choose_allreduce_algo(bytes, W, true));
    text += fmt::format("  {:>6} {:>9}  {:>10.2f} {:>10.2f} {:>10.2f}   {:<14} {:<8}  {}\n", rows, size_text(bytes), a,
                        b, c, best, table, oracle(m));
    md += fmt::format("md|| {} | fused {} rows ({}) | {:.2f} | {:.2f} | {:.2f} | {} | {} | {} |\n", W, rows,
                      size_text(bytes), a, b, c, best, table, oracle(m));
  }
  text += fmt::format("  fused crossover one-shot -> two-shot: {}; symmetric memory -> NCCL+norm: {}\n",
                      fused_one_to_two < 0 ? "none in range" : "at " + size_text(fused_one_to_two),
                      fused_sym_to_nccl < 0 ? "none in range (symmetric memory wins everywhere)"
                                            : "at " + size_text(fused_sym_to_nccl));
  text += fmt::format("  verdict: {}\n", ok ? "PASS" : "FAIL (a symmetric variant differs from the oracle)");
  if (f.md_rows) text += md;
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
  return ok ? 0 : 1;
}
#endif

}  // namespace

void add_bench_allreduce_command(CLI::App& app) {
  auto f = std::make_shared<BenchAllReduceFlags>();
  CLI::App* sub = app.add_subcommand(
      "bench-allreduce",
      "Symmetric-memory all-reduce (one-shot, two-shot, fused + RMSNorm) vs ncclAllReduce across rank processes, one "
      "GPU each: pcpkv launch --nproc N --gpus 0,..,N-1 -- bench-allreduce");
  sub->add_option("--bytes", f->bytes, "Message sizes in bytes per rank, comma- or space-separated (default 8 KiB .. 64 MiB, x2 steps)")
      ->delimiter(',');
  sub->add_option("--hidden", f->hidden, "Row length of the fused variant (GLM-5: 6144)")->capture_default_str();
  sub->add_option("--repeats", f->repeats, "Graph replays per size and variant (median)")->capture_default_str();
  sub->add_flag("--no-check", f->no_check, "Skip the byte comparison with the CPU oracle");
  sub->add_flag("--md-rows", f->md_rows, "Also print markdown table rows prefixed 'md|' (for docs/perf.md)");
  sub->callback([f] {
    const int code = run_rank_program(
        "bench-allreduce", [&] { check_run_count("--repeats", f->repeats, 1); },
        [&](Bootstrap& world) {
          world.agree_on("", agreed_fields(*f));
#if defined(PCPKV_HAVE_CUDA)
          return bench_allreduce(*f, world);
#else
          PCPKV_FAIL("bench-allreduce needs a CUDA build of pcpkv");
          return 2;
#endif
        });
    if (code != 0) throw CLI::RuntimeError("", code);
  });
}

}  // namespace pcpkv::cli
