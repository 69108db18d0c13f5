// `pcpkv bench-link`: the GPUs' link bandwidth with copy-engine peer copies (cudaMemcpyPeerAsync), from ONE
// process holding every GPU: one pair one way, the pair both ways, and every ordered pair
// at once (what each GPU receives while all send to all: the reference for a PCP publication's P2P stores).
// Not a rank command: run it on its own, before or after the launched benchmarks.
#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "launch_cmds.h"
#include "list_flags.h"
#include "pcpkv/flag_checks.h"
#include "pcpkv/core/error.h"
#include "pcpkv_bench/link.h"
#if defined(PCPKV_HAVE_CUDA)
#include "pcpkv/publish/cuda_multiproc.h"
#endif

namespace pcpkv::cli {
namespace {

struct BenchLinkFlags {
  std::string gpus;
  double mib = 256;
  int32_t iters = 10;
  bool md_rows = false;
};

}  // namespace

void add_bench_link_command(CLI::App& app) {
  auto f = std::make_shared<BenchLinkFlags>();
  CLI::App* sub = app.add_subcommand(
      "bench-link", "Peer-copy bandwidth between this host's GPUs (cudaMemcpyPeerAsync): one pair, both ways, all pairs");
  CLI::Option* gpus = sub->add_option("--gpus", f->gpus, "Comma list of devices (default: every visible GPU)");
  sub->add_option("--mib", f->mib, "MiB per copy")->capture_default_str();
  sub->add_option("--iters", f->iters, "Copies per measurement")->capture_default_str();
  sub->add_flag("--md-rows", f->md_rows, "Also print a markdown table row prefixed 'md|' (for docs/perf.md)");
  sub->callback([f, gpus] {
    check_run_count("--iters", f->iters, 1);
    const std::vector<int32_t> devices = parse_device_list(f->gpus, "--gpus", gpus->count() > 0);
#if defined(PCPKV_HAVE_CUDA)
    cuda::LinkBenchOptions o;
    o.gpus = devices;
    PCPKV_CHECK(f->mib >= 1, "--mib must be >= 1, got {}", f->mib);
    o.bytes = static_cast<int64_t>(f->mib * 1024 * 1024) / 256 * 256;
    o.iters = f->iters;
    const cuda::LinkBenchResult r = cuda::bench_link(o);
    std::string text = fmt::format(
        "pcpkv bench-link: {} GPUs, {} MiB per copy, cudaMemcpyPeerAsync (copy engines), GB/s = 1e9 B/s\n"
        "  GPU {} -> GPU {} one way:            {:8.1f} GB/s\n"
        "  GPU {} <-> GPU {} both ways (sum):    {:8.1f} GB/s\n"
        "  all {} ordered pairs at once: each GPU receives {:8.1f} GB/s (all GPUs together {:.1f} GB/s)\n"
        "  device-to-device copy on GPU {} (HBM, for scale): {:.1f} GB/s\n",
        r.gpus.size(), r.bytes >> 20, r.gpus[0], r.gpus[1], r.pair_gbps, r.gpus[0], r.gpus[1], r.pair_bidir_gbps,
        r.gpus.size() * (r.gpus.size() - 1), r.all_pairs_recv_gbps, r.all_pairs_total_gbps, r.gpus[0],
        r.local_copy_gbps);
    // For scripts: the per-GPU receive bandwidth with all pairs busy (mp-publish --link-gbps).
    text += fmt::format("link-gbps-all-pairs-recv={:.1f}\n", r.all_pairs_recv_gbps);
    if (f->md_rows)
      text += fmt::format("md|| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |\n", r.gpus.size(), r.pair_gbps,
                          r.pair_bidir_gbps, r.all_pairs_recv_gbps, r.all_pairs_total_gbps, r.local_copy_gbps);
    std::fputs(text.c_str(), stdout);
    std::fflush(stdout);
#else
    (void)devices;  // checked above: a bad --gpus is named even where bench-link cannot run
    PCPKV_FAIL("bench-link needs a CUDA build of pcpkv");
#endif
  });
}

}  // namespace pcpkv::cli
