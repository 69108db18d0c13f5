// `pcpkv bench` measurements (pcpkv/publish/cuda.h run_bench): the device-to-device copy bandwidth, the fused
// dispatch alone on one rank (docs/perf.md's vLLM comparison), and one layer's publication for every
// (model, PCP, kv format, transport) with per-stage CUDA-event times and a CUDA-graph replay. The CLI
// (tools/pcpkv/cmd_bench.cpp) turns the report into tables and JSON.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "bench/cuda/graph_timer.h"
#include "core/cuda/buffers.h"
#include "core/cuda/check.h"
#include "pcpkv/publish/kernels.h"
#include "publish/checks/cuda/device_replica_check.h"
#include "publish/drivers/cuda/publisher.h"
#include "pcpkv/publish/cuda.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/publish/replica_hash.h"
#include "pcpkv_bench/publish.h"

namespace pcpkv::cuda {
namespace {

using cuda::DeviceBuffer;
using cuda::DeviceReplicaCheck;
using cuda::DispatchVariant;
using cuda::Event;
using cuda::Publisher;
using cuda::PublisherOptions;
using cuda::PublishVariant;
using cuda::StageTimer;
using cuda::Stream;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void say(const std::function<void(const std::string&)>& progress, const std::string& line) {
  if (progress) progress(line);
}

/// One 2 GiB (by default) device-to-device copy, timed with events; bytes read + written per second.
double copy_bandwidth(double gib, int iters, int64_t* bytes_out) {
  const int64_t bytes = static_cast<int64_t>(gib * 1024.0 * 1024.0 * 1024.0) / 256 * 256;
  DeviceBuffer src(bytes), dst(bytes);
  PCPKV_CUDA_CHECK(cudaMemset(src.data(), 0x5A, static_cast<size_t>(bytes)));
  Stream s;
  Event a, b;
  std::vector<double> ms;
  for (int i = 0; i < iters + 2; ++i) {
    PCPKV_CUDA_CHECK(cudaEventRecord(a.get(), s.get()));
    PCPKV_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s.get()));
    PCPKV_CUDA_CHECK(cudaEventRecord(b.get(), s.get()));
    s.sync();
    if (i >= 2) ms.push_back(cuda::elapsed_ms(a, b));
  }
  *bytes_out = bytes;
  return 2.0 * static_cast<double>(bytes) / (median(ms) * 1e-3) / 1e9;
}

PcpPlan one_prefill_plan(int32_t pcp, int64_t tokens, int32_t block_size, uint64_t seed) {
  PlanConfig pc;
  pc.pcp_world = pcp;
  pc.block_size = block_size;
  pc.requests = {{RequestKind::kPrefill, tokens, 0}};
  pc.seed = seed;
  return make_plan(pc);
}

/// Input sets so that one rotation (inputs + per-run outputs) is at least 3x the L2.
int sets_for(int64_t set_bytes, int64_t l2_bytes) {
  if (set_bytes <= 0) return 1;
  return static_cast<int>(std::clamp<int64_t>((3 * l2_bytes + set_bytes - 1) / set_bytes, 1, 16));
}

/// A publisher whose rotation defeats the L2 (rebuilt with more input sets when one set is too small).
std::unique_ptr<Publisher> make_publisher(const PublishSetup& setup, const GlobalInputs& in, PublisherOptions opts,
                                          int64_t l2_bytes) {
  opts.num_sets = 1;
  auto pub = std::make_unique<Publisher>(setup, in, opts);
  const int sets = sets_for(pub->input_set_bytes(), l2_bytes);
  if (sets > 1) {
    pub.reset();
    opts.num_sets = sets;
    pub = std::make_unique<Publisher>(setup, in, opts);
  }
  return pub;
}

struct Timed {
  std::vector<BenchStage> stages;
  double total_ms = 0.0;
  double total_min_ms = 0.0;
};

/// warmup + iters runs of one transport; per-stage medians and the median of the per-run totals.
Timed time_transport(Publisher& pub, Transport t, const BenchOptions& o) {
  Stream stream;
  for (int i = 0; i < o.warmup; ++i) pub.enqueue(t, stream.get());
  stream.sync();
  pub.check_fence();
  StageTimer timer;
  std::map<std::string, std::vector<double>> per_stage;
  std::vector<double> totals;
  for (int i = 0; i < o.iters; ++i) {
    pub.enqueue(t, stream.get(), &timer);
    stream.sync();
    double total = 0.0;
    for (const auto& [name, ms] : timer.read()) {
      per_stage[name].push_back(ms);
      total += ms;
    }
    totals.push_back(total);
  }
  pub.check_fence();
  Timed out;
  for (const Stage& s : pub.stage_model(t)) out.stages.push_back({s.name, median(per_stage[s.name]), s.bytes});
  out.total_ms = median(totals);
  out.total_min_ms = *std::min_element(totals.begin(), totals.end());
  return out;
}

/// warmup + iters runs of rank `rank`'s dispatch alone (Publisher::enqueue_rank_dispatch); median ms.
double time_rank_dispatch(Publisher& pub, int32_t rank, Transport t, const BenchOptions& o) {
  Stream stream;
  for (int i = 0; i < o.warmup; ++i) pub.enqueue_rank_dispatch(rank, t, stream.get());
  stream.sync();
  Event a, b;
  std::vector<double> ms;
  for (int i = 0; i < o.iters; ++i) {
    PCPKV_CUDA_CHECK(cudaEventRecord(a.get(), stream.get()));
    pub.enqueue_rank_dispatch(rank, t, stream.get());
    PCPKV_CUDA_CHECK(cudaEventRecord(b.get(), stream.get()));
    stream.sync();
    ms.push_back(cuda::elapsed_ms(a, b));
  }
  return median(ms);
}

/// Median per call of o.graph_calls runs of rank `rank`'s dispatch captured into one CUDA graph (input sets
/// rotating as in time_rank_dispatch); -1 without o.graph. Back-to-back launches: what a layer's dispatch costs
/// on a busy GPU, without the host launch path that a launch on an idle GPU (time_rank_dispatch) includes.
double graph_rank_dispatch(Publisher& pub, int32_t rank, Transport t, const BenchOptions& o) {
  if (!o.graph) return -1.0;
  Stream stream;
  pub.enqueue_rank_dispatch(rank, t, stream.get());  // warm outside the capture
  stream.sync();
  const double us = cuda::graph_median_us_per_call(
      [&](cudaStream_t s, int64_t) { pub.enqueue_rank_dispatch(rank, t, s); }, o.graph_calls, o.warmup, o.iters,
      stream.get());
  return us * 1e-3;
}

std::string graph_note(double graph_ms, double floor_ms) {
  return graph_ms < 0 ? std::string() : fmt::format(", graph {:.1f} us ({:.2f}x)", graph_ms * 1e3, graph_ms / floor_ms);
}

/// Median replay time of `layers` publications captured back to back into one graph, divided by layers.
double time_graph(Publisher& pub, Transport t, const BenchOptions& o, int layers = 1) {
  Stream stream;
  pub.enqueue(t, stream.get());  // warm (module load, occupancy queries) outside the capture
  stream.sync();
  cudaGraph_t graph = nullptr;
  PCPKV_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < layers; ++l) pub.enqueue(t, stream.get());
  PCPKV_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  PCPKV_CUDA_CHECK(inst);
  Event a, b;
  std::vector<double> ms;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    PCPKV_CUDA_CHECK(cudaEventRecord(a.get(), stream.get()));
    PCPKV_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    PCPKV_CUDA_CHECK(cudaEventRecord(b.get(), stream.get()));
    stream.sync();
    if (i >= o.warmup) ms.push_back(cuda::elapsed_ms(a, b));
  }
  cudaGraphExecDestroy(exec);
  pub.check_fence();
  return median(ms) / layers;
}

/// The replica check after one direct publication (its caches then hold every written row on every replica):
/// warmup + iters runs of DeviceReplicaCheck::enqueue, CUDA events around each; the result of the last.
BenchReplicaCheck time_replica_check(Publisher& pub, const PcpPlan& plan, const CacheFormat& fmt, const BenchOptions& o) {
  Stream stream;
  pub.enqueue(Transport::kDirect, stream.get());
  stream.sync();
  pub.check_fence();
  DeviceReplicaCheck check(pub.targets(), fmt, written_slots(plan), written_index_slots(plan));
  Event a, b;
  std::vector<double> ms;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    PCPKV_CUDA_CHECK(cudaEventRecord(a.get(), stream.get()));
    check.enqueue(stream.get());
    PCPKV_CUDA_CHECK(cudaEventRecord(b.get(), stream.get()));
    stream.sync();
    if (i >= o.warmup) ms.push_back(cuda::elapsed_ms(a, b));
  }
  BenchReplicaCheck r;
  r.pcp = plan.pcp_world;
  r.kv_format = fmt.kv_format;
  r.indexer_layer = fmt.has_indexer;
  r.slots = static_cast<int64_t>(check.slots().size());
  r.ms = median(ms);
  r.cache_bytes_read = check.cache_bytes_read();
  r.bytes = check.bytes();
  const Check c = replica_hash_check(check.diffs(), check.slots(), check.bytes_per_slot(), {0, "direct", ""});
  r.pass = c.pass;
  r.detail = c.detail;
  return r;
}

PublishSetup make_setup(const ModelConfig& model, const PcpPlan& plan, const CacheFormat& fmt, int64_t topk_width) {
  PublishSetup s;
  s.model = &model;
  s.plan = &plan;
  s.fmt = fmt;
  s.topk_width = topk_width;
  s.materialize_q = true;
  return s;
}

}  // namespace

BenchReport run_bench(const BenchOptions& o, const std::function<void(const std::string&)>& progress) {
  PCPKV_CHECK(o.iters >= 1, "--iters = {} must be >= 1", o.iters);
  PCPKV_CHECK(o.warmup >= 0, "--warmup = {} must be >= 0", o.warmup);
  PCPKV_CHECK(o.tokens >= 1, "--tokens = {} must be >= 1", o.tokens);
  PCPKV_CHECK(o.copy_gib > 0.0 && o.copy_gib <= 64.0, "--copy-gib = {} must be in (0, 64]", o.copy_gib);
  for (int32_t p : o.pcp) PCPKV_CHECK(p >= 1 && p <= 8, "--pcp {}: the one-GPU bench serves 1..8 ranks", p);
  const int32_t replica_check_pcp =
      o.replica_check_pcp == -1 && !o.pcp.empty() ? *std::max_element(o.pcp.begin(), o.pcp.end()) : o.replica_check_pcp;
  PCPKV_CHECK(replica_check_pcp <= 0 || std::find(o.pcp.begin(), o.pcp.end(), replica_check_pcp) != o.pcp.end(),
              "--replica-check-pcp {} is not one of the --pcp worlds", replica_check_pcp);
  std::string why;
  const int n = device_count(&why);
  PCPKV_CHECK(n > 0, "pcpkv bench needs a CUDA device: {}", why);
  PCPKV_CHECK(o.device_idx >= 0 && o.device_idx < n, "--device {} does not exist ({} visible)", o.device_idx, n);
  PCPKV_CUDA_CHECK(cudaSetDevice(o.device_idx));

  BenchReport rep;
  cudaDeviceProp prop{};
  PCPKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, o.device_idx));
  rep.device = prop.name;
  rep.num_sms = prop.multiProcessorCount;
  rep.l2_bytes = prop.l2CacheSize;
  say(progress, fmt::format("device: {} ({} SMs, {} MB L2)", rep.device, rep.num_sms, rep.l2_bytes >> 20));

  rep.copy_gbps = copy_bandwidth(o.copy_gib, std::max(o.iters / 2, 5), &rep.copy_bytes);
  say(progress, fmt::format("copy bandwidth: {:.0f} GB/s (read + write of {:.2f} GiB, device to device)",
                            rep.copy_gbps, static_cast<double>(rep.copy_bytes) / (1 << 30)));
  rep.kernels = cuda::dispatch_kernel_resources();

  CacheFormat ds_mla;
  ds_mla.kv_format = KvFormat::kFp8DsMla;
  ds_mla.has_indexer = true;

  // ---- the dispatch alone on one rank (GLM-5, fp8_ds_mla, indexer layer, top-k fill) ----
  std::vector<DispatchVariant> single_variants;
  for (const std::string& v : o.single_rank_variants) single_variants.push_back(cuda::parse_dispatch_variant(v));
  std::vector<PublishVariant> layer_variants;
  for (const std::string& v : o.layer_variants) layer_variants.push_back(PublishVariant::parse(v));
  PCPKV_CHECK(!layer_variants.empty(), "--layer-variants must name at least one variant");
  if (!o.single_rank_tokens.empty()) {
    const ModelConfig model = preset("glm-5");
    for (int64_t tokens : o.single_rank_tokens) {
      const PcpPlan plan = one_prefill_plan(1, tokens, o.block_size, o.seed);
      const GlobalInputs in = generate_inputs(model, plan, true, o.seed);
      PublishSetup setup = make_setup(model, plan, ds_mla, o.topk_width);
      setup.topk_fill_mode = o.topk_fill;
      auto pub = make_publisher(setup, in, PublisherOptions{}, rep.l2_bytes);
      for (DispatchVariant v : single_variants)
        for (bool fused : {true, false}) {
          PublishVariant pv;
          pv.dispatch = v;
          pv.fuse_topk = fused;
          pv.pdl = false;
          pub->set_variant(pv);
          const Timed t = time_transport(*pub, Transport::kDirect, o);
          BenchSingle s;
          s.model = "glm-5";
          s.tokens = tokens;
          s.variant = cuda::to_string(v);
          s.fused_topk = fused;
          s.topk_fill = o.topk_fill;
          // Dispatch (+ the separate fill): the fence of a one-rank "direct" is not part of the work.
          for (const BenchStage& st : t.stages)
            if (st.name == "dispatch" || st.name == "topk-fill") {
              s.ms += st.ms;
              s.bytes += st.bytes;
            }
          s.ms_min = s.ms * t.total_min_ms / std::max(t.total_ms, 1e-9);
          s.graph_ms = graph_rank_dispatch(*pub, 0, Transport::kDirect, o);
          const double floor_ms = static_cast<double>(s.bytes) / (rep.copy_gbps * 1e6);
          say(progress, fmt::format("single rank {} tokens, {} {}: {:.1f} us ({:.2f}x the copy floor){}", tokens,
                                    s.variant, fused ? "fused top-k" : "separate top-k", s.ms * 1e3, s.ms / floor_ms,
                                    graph_note(s.graph_ms, floor_ms)));
          rep.singles.push_back(s);
        }
    }
  }

  // ---- the per-GPU case: rank 0's dispatch alone in a PCP group ----
  if (o.per_gpu_pcp > 0) {
    const int32_t P = o.per_gpu_pcp;
    PCPKV_CHECK(P <= 8, "--per-gpu-pcp {}: the one-GPU bench serves 1..8 ranks", P);
    // Even DualChunkSwap split (2P equal chunks), so every rank has the same rows and rank 0's bytes are
    // the stage model's over P.
    PCPKV_CHECK(o.per_gpu_tokens >= 2 * P && o.per_gpu_tokens % (2 * P) == 0,
                "--per-gpu-tokens {} must be a positive multiple of 2 x --per-gpu-pcp = {}", o.per_gpu_tokens, 2 * P);
    const PcpPlan plan = one_prefill_plan(P, o.per_gpu_tokens, o.block_size, o.seed);
    for (const std::string& name : o.models) {
      const ModelConfig model = preset(name);
      const GlobalInputs in = generate_inputs(model, plan, true, o.seed);
      PublishSetup setup = make_setup(model, plan, ds_mla, o.topk_width);
      setup.topk_fill_mode = o.topk_fill;  // staging / direct: the bench's --topk-fill
      auto pub = make_publisher(setup, in, PublisherOptions{}, rep.l2_bytes);
      std::vector<std::string> seen;
      for (PublishVariant v : layer_variants) {
        v.combine_rows_per_warp = 0;  // dispatch kernel and fill only
        v.pdl = false;
        if (std::find(seen.begin(), seen.end(), v.name()) != seen.end()) continue;
        seen.push_back(v.name());
        pub->set_variant(v);
        for (Transport t : {Transport::kStaging, Transport::kDirect}) {
          BenchPerGpu row;
          row.model = name;
          row.pcp = P;
          row.local_tokens = o.per_gpu_tokens / P;
          row.transport = t;
          row.variant = v.name();
          row.ms = time_rank_dispatch(*pub, 0, t, o);
          row.graph_ms = graph_rank_dispatch(*pub, 0, t, o);
          for (const Stage& st : pub->stage_model(t))
            if (st.name == "dispatch" || st.name == "topk-fill") row.bytes += st.bytes / P;
          const double floor_ms = static_cast<double>(row.bytes) / (rep.copy_gbps * 1e6);
          say(progress, fmt::format("per GPU {} PCP {} rank 0 ({} rows) {} [{}]: {:.1f} us ({:.2f}x the copy floor){}",
                                    name, P, row.local_tokens, to_string(t), row.variant, row.ms * 1e3,
                                    row.ms / floor_ms, graph_note(row.graph_ms, floor_ms)));
          rep.per_gpu.push_back(row);
        }
      }
    }
  }

  // ---- one layer's publication per (model, PCP, format, transport) ----
  for (const std::string& name : o.models) {
    const ModelConfig model = preset(name);
    GlobalInputs inputs;
    bool have_inputs = false;
    for (int32_t P : o.pcp) {
      const PcpPlan plan = one_prefill_plan(P, o.tokens, o.block_size, o.seed);
      if (!have_inputs) {  // global inputs do not depend on P (same requests, same positions)
        inputs = generate_inputs(model, plan, o.indexer_layer, o.seed);
        have_inputs = true;
      }
      for (KvFormat f : o.kv_formats) {
        CacheFormat fmt;
        fmt.kv_format = f;
        fmt.k_scale = f == KvFormat::kFp8 ? 0.02f : 1.0f;  // a non-power-of-two static scale: true divisions
        fmt.has_indexer = o.indexer_layer;
        const PublishSetup setup = make_setup(model, plan, fmt, o.indexer_layer ? o.topk_width : 0);
        auto pub = make_publisher(setup, inputs, PublisherOptions{}, rep.l2_bytes);
        std::string line = fmt::format("{} PCP {} {}:", name, P, to_string(f));
        for (Transport t : o.transports) {
          // collect: its pinned engine baseline once; staging / direct: every requested variant.
          const std::vector<PublishVariant> variants =
              t == Transport::kCollect ? std::vector<PublishVariant>{cuda::collect_baseline_variant()} : layer_variants;
          for (const PublishVariant& v : variants) {
            pub->set_variant(v);
            pub->set_topk_fill(t == Transport::kCollect ? TopkFill::kFull : o.topk_fill);
            const Timed timed = time_transport(*pub, t, o);
            BenchRun run;
            run.model = name;
            run.pcp = P;
            run.kv_format = f;
            run.indexer_layer = o.indexer_layer;
            run.tokens = o.tokens;
            run.transport = t;
            run.variant = v.name();
            run.topk_fill = pub->topk_fill();
            run.stages = timed.stages;
            run.total_ms = timed.total_ms;
            for (const BenchStage& s : run.stages) run.bytes += s.bytes;
            if (o.graph) run.graph_ms = time_graph(*pub, t, o);
            line += fmt::format(" {} [{}] {:.3f} ms", to_string(t), run.variant, run.total_ms);
            rep.runs.push_back(std::move(run));
          }
        }
        if (P == replica_check_pcp) {  // the debug check's cost: its own row, not part of any total above
          BenchReplicaCheck rc = time_replica_check(*pub, plan, fmt, o);
          rc.model = name;
          rc.tokens = o.tokens;
          line += fmt::format(" replica-check {:.3f} ms ({})", rc.ms, rc.pass ? "pass" : "FAIL");
          rep.replica_checks.push_back(std::move(rc));
        }
        say(progress, line);
      }
    }
  }
  // ---- PDL off / on: the staging / direct chain at decode-like token counts (graph replay) ----
  if (!o.pdl_tokens.empty()) {
    PCPKV_CHECK(o.pdl_pcp >= 1 && o.pdl_pcp <= 8, "--pdl-pcp {}: the one-GPU bench serves 1..8 ranks", o.pdl_pcp);
    PCPKV_CHECK(o.pdl_layers >= 1, "--pdl-layers = {} must be >= 1", o.pdl_layers);
    const ModelConfig model = preset("glm-5");
    PublishVariant kernels = layer_variants.back();
    for (int64_t tokens : o.pdl_tokens) {
      PCPKV_CHECK(tokens >= 1, "--pdl-tokens: {} must be >= 1", tokens);
      const PcpPlan plan = one_prefill_plan(o.pdl_pcp, tokens, o.block_size, o.seed);
      const GlobalInputs in = generate_inputs(model, plan, true, o.seed);
      PublishSetup setup = make_setup(model, plan, ds_mla, o.topk_width);
      setup.topk_fill_mode = o.topk_fill;
      auto pub = make_publisher(setup, in, PublisherOptions{}, rep.l2_bytes);
      for (Transport t : {Transport::kStaging, Transport::kDirect}) {
        BenchPdl row;
        row.model = "glm-5";
        row.pcp = o.pdl_pcp;
        row.tokens = tokens;
        row.transport = t;
        row.layers = o.pdl_layers;
        kernels.pdl = false;
        row.variant = kernels.name();
        pub->set_variant(kernels);
        row.us_off = 1e3 * time_graph(*pub, t, o, o.pdl_layers);
        kernels.pdl = true;
        pub->set_variant(kernels);
        row.us_on = 1e3 * time_graph(*pub, t, o, o.pdl_layers);
        say(progress, fmt::format("PDL {} tokens PCP {} {} [{}]: {:.2f} us off, {:.2f} us on per layer", tokens,
                                  o.pdl_pcp, to_string(t), row.variant, row.us_off, row.us_on));
        rep.pdl.push_back(row);
      }
    }
  }
  return rep;
}

}  // namespace pcpkv::cuda
