// The all-reduce across rank processes, symmetric memory against NCCL (cuda::bench_allreduce_sweep in
// pcpkv/publish/cuda_multiproc.h). Uses the serving engineer's per-process cuda::AllReduce (pcpkv/serving/allreduce.h) as
// is: one instance over device symmetric memory, and one that is refused symmetric memory on purpose (null
// workspaces, every rank agrees "no") so that it takes its NCCL fallback: ncclAllReduce, plus for the fused
// variant the one-rank residual-add + RMSNorm kernel, i.e. what an engine without symmetric memory runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda/buffers.h"
#include "core/cuda/check.h"
#include "pcpkv/serving/allreduce.h"
#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/publish/cuda_multiproc.h"
#include "pcpkv/core/error.h"
#include "pcpkv/publish/multiproc.h"
#include "pcpkv/ranks/symmetric.h"
#include "pcpkv_bench/allreduce.h"
#include "pcpkv_bench/fence.h"

#if defined(PCPKV_HAVE_NCCL)
#include <nccl.h>
#endif

namespace pcpkv::cuda {

#if defined(PCPKV_HAVE_NCCL)
namespace {

using cuda::DeviceBuffer;
using cuda::Event;
using cuda::Stream;

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint16_t to_bf16(float f) {  // round to nearest even; inputs are finite
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// [n] bf16 of stream `which`: uniform in (-1, 1), never zero, with outlier channels (every 97th, x 40).
std::vector<uint16_t> random_bf16(uint64_t seed, uint64_t which, int64_t n) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  const uint64_t base = mix(seed * 1000003ull + which);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = mix(base + static_cast<uint64_t>(i));
    float x = static_cast<float>(static_cast<double>(h >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    if (x > -1e-3f && x < 1e-3f) x = 0.5f;
    if (i % 97 == 3) x *= 40.0f;
    v[static_cast<size_t>(i)] = to_bf16(x);
  }
  return v;
}

struct Comm {
  ncclComm_t comm = nullptr;
  explicit Comm(Bootstrap& group) {
    ncclUniqueId id{};
    if (group.rank() == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      PCPKV_CHECK(r == ncclSuccess, "ncclGetUniqueId failed: {}", ncclGetErrorString(r));
    }
    std::vector<ncclUniqueId> ids(static_cast<size_t>(group.world_size()));
    group.all_gather(&id, sizeof(id), ids.data());
    const ncclResult_t r = ncclCommInitRank(&comm, group.world_size(), ids[0], group.rank());
    PCPKV_CHECK(r == ncclSuccess, "ncclCommInitRank (rank {} of {}) failed: {}", group.rank(), group.world_size(),
                ncclGetErrorString(r));
  }
  ~Comm() {
    if (comm) ncclCommDestroy(comm);
  }
};

int64_t count_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  int64_t d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) d += a[i] != b[i];
  return d;
}

}  // namespace

AllReduceSweepResult bench_allreduce_sweep(Bootstrap& group, const AllReduceSweepOptions& o) {
  const int32_t W = group.world_size(), me = group.rank();
  PCPKV_CHECK(W >= 2 && W <= kAllReduceMaxRanks, "bench-allreduce: {} ranks; the all-reduce takes 2..{}", W,
              kAllReduceMaxRanks);
  PCPKV_CHECK(o.repeats >= 1, "bench-allreduce: repeats = {} must be >= 1", o.repeats);
  PCPKV_CHECK(o.hidden >= 8 && o.hidden % 8 == 0 && o.hidden <= kAllReduceMaxHidden,
              "bench-allreduce: hidden = {} must be a multiple of 8 in [8, {}]", o.hidden, kAllReduceMaxHidden);
  std::vector<int64_t> sizes = o.bytes;
  if (sizes.empty())
    for (int64_t b = 8 << 10; b <= (int64_t{64} << 20); b *= 2) sizes.push_back(b);
  for (int64_t b : sizes)
    PCPKV_CHECK(b >= 16 && b % 16 == 0, "bench-allreduce: message size {} B must be a positive multiple of 16", b);
  const int64_t max_bytes = *std::max_element(sizes.begin(), sizes.end());
  // Fused rows: powers of two with rows * hidden * 2 within the plain sizes' range (at least one row).
  std::vector<int64_t> fused_rows;
  for (int64_t r = 1; r * o.hidden * 2 <= max_bytes; r *= 2)
    if (r * o.hidden * 2 >= sizes.front() || r == 1) fused_rows.push_back(r);
  int64_t max_elems = max_bytes / 2;
  if (!fused_rows.empty()) max_elems = std::max(max_elems, fused_rows.back() * o.hidden);

  const int32_t device = select_rank_device(group);
  cudaDeviceProp prop{};
  PCPKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  AllReduceSweepResult res;
  res.world_size = W;
  res.device = fmt::format("{} (rank 0 on device {})", prop.name, device);
  {  // NCCL needs one GPU per rank; say so before NCCL does.
    char uuid[16];
    std::memcpy(uuid, prop.uuid.bytes, 16);
    std::vector<char> all(16 * static_cast<size_t>(W));
    group.all_gather(uuid, 16, all.data());
    for (int32_t a = 0; a < W; ++a)
      for (int32_t b = a + 1; b < W; ++b)
        PCPKV_CHECK(std::memcmp(&all[16 * a], &all[16 * b], 16) != 0,
                    "bench-allreduce: ranks {} and {} share a GPU; NCCL needs one GPU per rank (use --gpus 0,1,..)", a,
                    b);
  }
  Comm comm(group);
  AllReduceLayout layout;
  layout.max_elems = max_elems;
  auto ws = make_device_symmetric(group, layout.bytes(), "all-reduce workspace", 0);
  // The NCCL path: refused symmetric memory on every rank (null workspaces, a unanimous "no").
  AllReduce nccl_ar(me, std::vector<uint8_t*>(static_cast<size_t>(W), nullptr), max_elems,
                    [](bool) { return false; }, comm.comm);
  AllReduce sym_ar(*ws, group, max_elems, comm.comm);
  res.symmetric = sym_ar.uses_symmetric_memory();
  res.fallback_reason = sym_ar.fallback_reason();

  Stream stream;
  Event begin, end;
  DeviceBuffer d_in(max_elems * 2), d_out(max_elems * 2), d_res_in(max_elems * 2), d_res_out(max_elems * 2),
      d_w(o.hidden * 4);
  std::vector<float> weight(static_cast<size_t>(o.hidden));
  for (int64_t k = 0; k < o.hidden; ++k)
    weight[static_cast<size_t>(k)] = 0.5f + static_cast<float>(mix(o.seed ^ 0x77u ^ static_cast<uint64_t>(k)) % 1024) / 1024.0f;
  d_w.upload(weight);
  const AllReduceNorm dev_norm{o.hidden, d_w.as<const float>(), 1e-5f};
  const AllReduceNorm host_norm{o.hidden, weight.data(), 1e-5f};
  AllReduceOptions base;
  base.timeout_ns = o.timeout_ns;

  // Times `call` (one all-reduce on the stream): a graph of `calls` back-to-back calls, replayed `repeats`
  // times; before each replay a host barrier and one eager call, which absorbs the ranks' start skew.
  auto time_us = [&](const std::function<void(cudaStream_t)>& call, int64_t bytes) {
    const int32_t calls = bytes <= (int64_t{1} << 20) ? 20 : bytes <= (int64_t{8} << 20) ? 8 : 3;
    call(stream.get());  // warm-up (and lazy module loading) outside the capture
    call(stream.get());
    stream.sync();
    cudaGraph_t graph = nullptr;
    PCPKV_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
    try {
      for (int32_t c = 0; c < calls; ++c) call(stream.get());
    } catch (...) {
      cudaStreamEndCapture(stream.get(), &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    PCPKV_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    PCPKV_CUDA_CHECK(inst);
    std::vector<double> us;
    for (int32_t rep = 0; rep < o.repeats; ++rep) {
      group.barrier();
      call(stream.get());
      PCPKV_CUDA_CHECK(cudaEventRecord(begin.get(), stream.get()));
      PCPKV_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
      PCPKV_CUDA_CHECK(cudaEventRecord(end.get(), stream.get()));
      stream.sync();
      us.push_back(1000.0 * cuda::elapsed_ms(begin, end) / calls);
    }
    cudaGraphExecDestroy(exec);
    return percentile(us, 0.5);
  };

  struct Local {
    int64_t bytes;
    std::string variant;
    double us;
    int64_t mismatches;
  };
  std::vector<Local> mine;
  const std::vector<std::pair<std::string, AllReduceAlgo>> algos = {{"oneshot", AllReduceAlgo::kOneShot},
                                                                   {"twoshot", AllReduceAlgo::kTwoShot}};
  // Plain all-reduce.
  for (size_t si = 0; si < sizes.size(); ++si) {
    const int64_t n = sizes[si] / 2;
    std::vector<std::vector<uint16_t>> inputs;
    for (int32_t r = 0; r < W; ++r)
      if (o.check || r == me) inputs.push_back(random_bf16(o.seed + si, static_cast<uint64_t>(r), n));
      else inputs.emplace_back();
    std::vector<uint16_t> expect;
    if (o.check) {
      std::vector<const uint16_t*> ptrs;
      for (const auto& v : inputs) ptrs.push_back(v.data());
      expect.resize(static_cast<size_t>(n));
      allreduce_reference(ptrs, n, expect.data());
    }
    d_in.upload(inputs[static_cast<size_t>(me)]);
    auto run_variant = [&](const std::string& name, AllReduce& ar, AllReduceAlgo algo) {
      PCPKV_CUDA_CHECK(cudaMemset(d_out.data(), 0xA5, static_cast<size_t>(n * 2)));
      AllReduceOptions opt = base;
      opt.algo = algo;
      const double us = time_us(
          [&](cudaStream_t s) { ar.run(d_in.as<const uint16_t>(), d_out.as<uint16_t>(), n, s, opt); }, n * 2);
      ar.check();
      int64_t mis = -1;
      if (o.check) mis = count_diff(d_out.download<uint16_t>(n), expect);
      mine.push_back({n * 2, name, us, mis});
    };
    run_variant("nccl", nccl_ar, AllReduceAlgo::kAuto);
    if (res.symmetric)
      for (const auto& [name, algo] : algos) run_variant(name, sym_ar, algo);
  }
  // Fused all-reduce + residual add + RMSNorm, [rows, hidden].
  for (size_t fi = 0; fi < fused_rows.size(); ++fi) {
    const int64_t rows = fused_rows[fi], n = rows * o.hidden;
    std::vector<std::vector<uint16_t>> inputs;
    for (int32_t r = 0; r < W; ++r)
      if (o.check || r == me) inputs.push_back(random_bf16(o.seed + 1000 + fi, static_cast<uint64_t>(r), n));
      else inputs.emplace_back();
    const std::vector<uint16_t> residual = random_bf16(o.seed + 1000 + fi, 999, n);  // the same on every rank
    std::vector<uint16_t> expect_y, expect_res;
    if (o.check) {
      std::vector<const uint16_t*> ptrs;
      for (const auto& v : inputs) ptrs.push_back(v.data());
      expect_y.resize(static_cast<size_t>(n));
      expect_res.resize(static_cast<size_t>(n));
      allreduce_rmsnorm_reference(ptrs, rows, host_norm, residual.data(), expect_res.data(), expect_y.data());
    }
    d_in.upload(inputs[static_cast<size_t>(me)]);
    d_res_in.upload(residual);
    auto run_variant = [&](const std::string& name, AllReduce& ar, AllReduceAlgo algo) {
      PCPKV_CUDA_CHECK(cudaMemset(d_out.data(), 0xA5, static_cast<size_t>(n * 2)));
      PCPKV_CUDA_CHECK(cudaMemset(d_res_out.data(), 0xA5, static_cast<size_t>(n * 2)));
      AllReduceOptions opt = base;
      opt.algo = algo;
      const double us = time_us(
          [&](cudaStream_t s) {
            ar.run_fused(d_in.as<const uint16_t>(), d_res_in.as<const uint16_t>(), d_res_out.as<uint16_t>(),
                         d_out.as<uint16_t>(), rows, dev_norm, s, opt);
          },
          n * 2);
      ar.check();
      int64_t mis = -1;
      if (o.check)
        mis = count_diff(d_out.download<uint16_t>(n), expect_y) + count_diff(d_res_out.download<uint16_t>(n), expect_res);
      mine.push_back({n * 2, name, us, mis});
    };
    run_variant("nccl-fused", nccl_ar, AllReduceAlgo::kAuto);
    if (res.symmetric)
      for (const auto& [name, algo] : algos) run_variant("fused-" + name, sym_ar, algo);
  }
  // Every rank ran the same sequence: gather the medians and mismatch counts.
  std::vector<double> us(mine.size());
  std::vector<int64_t> mis(mine.size());
  for (size_t k = 0; k < mine.size(); ++k) {
    us[k] = mine[k].us;
    mis[k] = mine[k].mismatches;
  }
  std::vector<double> all_us(us.size() * static_cast<size_t>(W));
  std::vector<int64_t> all_mis(mis.size() * static_cast<size_t>(W));
  group.all_gather(us.data(), us.size() * sizeof(double), all_us.data());
  group.all_gather(mis.data(), mis.size() * sizeof(int64_t), all_mis.data());
  for (size_t k = 0; k < mine.size(); ++k) {
    AllReduceSweepRow row;
    row.bytes = mine[k].bytes;
    row.variant = mine[k].variant;
    row.mismatches = mine[k].mismatches < 0 ? -1 : 0;
    for (int32_t r = 0; r < W; ++r) {
      const double v = all_us[static_cast<size_t>(r) * mine.size() + k];
      row.rank_us.push_back(v);
      row.us = std::max(row.us, v);
      const int64_t m = all_mis[static_cast<size_t>(r) * mine.size() + k];
      if (m > 0) row.mismatches += m;
    }
    res.rows.push_back(row);
  }
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  group.barrier();  // nobody unmaps a workspace a peer may still read
  return res;
}

#else

AllReduceSweepResult bench_allreduce_sweep(Bootstrap&, const AllReduceSweepOptions&) {
  PCPKV_FAIL("bench-allreduce: this pcpkv was built without NCCL (nccl.h / libnccl not found at configure time)");
}

#endif

}  // namespace pcpkv::cuda
