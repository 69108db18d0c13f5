// Benchmark of the CUDA consumers for one layer (attention_check.h ConsumerBenchResult): the indexer
// (scores + top-k) and sparse MLA attention of one causal prefill, against ceilings measured in the same
// run (2 GiB device copy; an FMA-bound kernel).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "consumers/checks/attention_check_internal.h"
#include "pcpkv/consumers/attention_check.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv_bench/consumers.h"

namespace pcpkv::cuda {

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) PCPKV_FAIL("consumer bench: {}: {}", what, cudaGetErrorString(e));
}

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) { check_cuda(cudaMalloc(&p, std::max<size_t>(bytes, 16)), "cudaMalloc"); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() { cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// ---- seeded device fills (statistics like generate_queries: log-normal rows, outlier channels) ----
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/// Approximately normal: sum of 4 uniforms, centred and scaled to unit variance.
__device__ __forceinline__ float dev_normal(uint64_t seed, uint64_t i) {
  const uint64_t a = mix64(seed ^ mix64(i)), b = mix64(a);
  const float u = ((a & 0xffffffu) + (a >> 40 & 0xffffffu) + (b & 0xffffffu) + (b >> 40 & 0xffffffu)) *
                  (1.0f / 16777216.0f);
  return (u - 2.0f) * 1.7320508f;
}
__device__ __forceinline__ float row_value(uint64_t seed, int64_t row, int d, float sigma) {
  const float mag = expf(0.5f * dev_normal(seed ^ 0x51ull, row));
  float v = dev_normal(seed, row * 1024 + d) * sigma * mag;
  if ((d * 37) % 97 == 0) v *= 20.0f;
  return v;
}

__global__ void fill_bf16_rows(uint16_t* out, int64_t rows, int width, float sigma, uint64_t seed) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= rows * width) return;
  out[i] = codec::float_to_bf16(row_value(seed, i / width, static_cast<int>(i % width), sigma));
}

__global__ void fill_f32(float* out, int64_t n, uint64_t seed) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i < n) out[i] = dev_normal(seed, i);
}

/// One warp per (token, head) row of 128: bf16 draw, UE8M0 scale, E4M3 bytes (quantize_index_queries).
__global__ void fill_index_q(uint8_t* q, float* scale, int64_t rows, uint64_t seed) {
  const int64_t r = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  float v[4], amax = 0.0f;
  for (int e = 0; e < 4; ++e) {
    v[e] = codec::bf16_to_float(codec::float_to_bf16(row_value(seed, r, lane * 4 + e, 1.0f)));
    amax = fp32::amax(amax, fp32::abs(v[e]));
  }
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = codec::indexer_scale(amax);
  for (int e = 0; e < 4; ++e) q[r * 128 + lane * 4 + e] = codec::quantize_e4m3(v[e], s);
  if (lane == 0) scale[r] = s;
}

/// FMA ceiling: 8 independent chains per thread.
__global__ void fma_peak(float* sink, int iters, float a, float b) {
  float x[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = threadIdx.x * 1e-3f + k;
  for (int i = 0; i < iters; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = fmaf(x[k], a, b);
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += x[k];
  if (s == 1234.5f) sink[0] = s;  // keeps the chains alive
}

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

/// Median of `repeats` timings (ms) of fn on the stream, after one warm-up.
template <class F>
double time_ms(F&& fn, int repeats, cudaStream_t s) {
  cudaEvent_t e0, e1;
  check_cuda(cudaEventCreate(&e0), "event");
  check_cuda(cudaEventCreate(&e1), "event");
  fn();
  check_cuda(cudaStreamSynchronize(s), "warm-up");
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    check_cuda(cudaEventRecord(e0, s), "event");
    fn();
    check_cuda(cudaEventRecord(e1, s), "event");
    check_cuda(cudaEventSynchronize(e1), "run");
    float m = 0.0f;
    check_cuda(cudaEventElapsedTime(&m, e0, e1), "elapsed");
    ms.push_back(m);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

ConsumerBenchResult bench_consumers(const ConsumerBenchConfig& cfg, const ModelConfig& model) {
  PCPKV_CHECK(cfg.num_tokens >= 1 && cfg.num_tokens < (int64_t{1} << 31), "bench: num_tokens must be >= 1, got {}",
              cfg.num_tokens);
  PCPKV_CHECK(cfg.topk >= 1 && cfg.topk <= 8192, "bench: topk must be in [1, 8192], got {}", cfg.topk);
  PCPKV_CHECK(cfg.repeats >= 1, "bench: repeats must be >= 1, got {}", cfg.repeats);
  int n_dev = 0;
  PCPKV_CHECK(cudaGetDeviceCount(&n_dev) == cudaSuccess && n_dev > 0, "bench: no CUDA device is visible");
  ConsumerBenchResult res;
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "properties");
  res.device = prop.name;
  cudaStream_t s;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");

  // ---- ceilings ----
  {
    const size_t bytes = size_t{2} << 30;
    Dev a(bytes), b(bytes);
    check_cuda(cudaMemsetAsync(a.p, 1, bytes, s), "memset");
    const double ms = time_ms([&] { check_cuda(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s), "copy"); },
                              3, s);
    res.copy_tbps = 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e12;
    Dev sink(16);
    const int iters = 4096, threads = 256;
    const unsigned blocks = static_cast<unsigned>(prop.multiProcessorCount * 8);
    const double fms = time_ms([&] { fma_peak<<<blocks, threads, 0, s>>>(sink.as<float>(), iters, 0.999f, 1e-3f); }, 3, s);
    res.fp32_tflops = 2.0 * 8.0 * iters * double(blocks) * threads / (fms * 1e-3) / 1e12;
  }

  // ---- problem: one causal prefill of T tokens, identity block table ----
  const int64_t T = cfg.num_tokens;
  const int32_t Hi = static_cast<int32_t>(model.index_n_heads), Hq = static_cast<int32_t>(model.num_attention_heads);
  const int32_t bs = 64;
  const int64_t num_blocks = (T + bs - 1) / bs;
  CacheFormat fmt;
  fmt.kv_format = cfg.kv_format;
  fmt.k_scale = 1.0f / 64.0f;
  MlaCacheGeometry mg;
  mg.num_blocks = num_blocks;
  mg.block_size = bs;
  mg.row_stride = mla_row_bytes(fmt.kv_format);
  mg.block_stride = mg.row_stride * bs;
  IndexerCacheGeometry ig;
  ig.num_blocks = num_blocks;
  ig.block_size = bs;
  ig.block_stride = int64_t{bs} * kIndexerSlotBytes;
  std::vector<uint8_t> mla(mg.bytes(), 0), idx(ig.bytes(), 0);
  attention_inputs::Rng rng{cfg.seed};
  for (int64_t slot = 0; slot < T; ++slot) {
    float kv_c[512], k_pe[64], k[128];
    attention_inputs::random_row(rng, kv_c, 512, 1.0, 3);
    attention_inputs::random_row(rng, k_pe, 64, 1.0, 4);
    attention_inputs::random_row(rng, k, 128, 1.0, 5);
    attention_inputs::encode_mla_row(kv_c, k_pe, fmt, mla.data() + mg.row_offset(slot));
    attention_inputs::encode_index_row(k, idx.data() + ig.data_offset(slot), idx.data() + ig.scale_offset(slot));
  }
  std::vector<int64_t> positions(T);
  std::vector<int32_t> req(T, 0), table(num_blocks);
  for (int64_t i = 0; i < T; ++i) positions[i] = i;
  for (int64_t b = 0; b < num_blocks; ++b) table[b] = static_cast<int32_t>(b);

  Dev d_mla(mla.size()), d_idx(idx.size()), d_pos(T * 8), d_req(T * 4), d_table(num_blocks * 4);
  check_cuda(cudaMemcpyAsync(d_mla.p, mla.data(), mla.size(), cudaMemcpyHostToDevice, s), "upload");
  check_cuda(cudaMemcpyAsync(d_idx.p, idx.data(), idx.size(), cudaMemcpyHostToDevice, s), "upload");
  check_cuda(cudaMemcpyAsync(d_pos.p, positions.data(), T * 8, cudaMemcpyHostToDevice, s), "upload");
  check_cuda(cudaMemcpyAsync(d_req.p, req.data(), T * 4, cudaMemcpyHostToDevice, s), "upload");
  check_cuda(cudaMemcpyAsync(d_table.p, table.data(), num_blocks * 4, cudaMemcpyHostToDevice, s), "upload");
  Dev d_iq(size_t(T) * Hi * 128), d_iscale(size_t(T) * Hi * 4), d_w(size_t(T) * Hi * 4);
  Dev d_q(size_t(T) * Hq * 576 * 2), d_topk(size_t(T) * cfg.topk * 4);
  fill_index_q<<<blocks_for(T * Hi * 32, 256), 256, 0, s>>>(d_iq.as<uint8_t>(), d_iscale.as<float>(), T * Hi, cfg.seed);
  fill_f32<<<blocks_for(T * Hi, 256), 256, 0, s>>>(d_w.as<float>(), T * Hi, cfg.seed + 1);
  fill_bf16_rows<<<blocks_for(T * Hq * 576, 256), 256, 0, s>>>(d_q.as<uint16_t>(), T * Hq, 576, 0.5f, cfg.seed + 2);
  check_cuda(cudaGetLastError(), "fill");

  // Tensor ceilings: H100/H200 SXM datasheet peaks scaled by the measured / datasheet fp32 ratio (clock).
  const double clock_ratio = res.fp32_tflops / 67.0;
  const double dmma_peak = 67.0 * clock_ratio, bf16_peak = 989.0 * clock_ratio;

  // ---- indexer ----
  IndexerParams ip;
  ip.num_tokens = T;
  ip.num_heads = Hi;
  ip.q_fp8 = d_iq.as<uint8_t>();
  ip.q_scale = d_iscale.as<float>();
  ip.weights = d_w.as<float>();
  ip.positions = d_pos.as<int64_t>();
  ip.request_idx = d_req.as<int32_t>();
  ip.block_tables = d_table.as<int32_t>();
  ip.num_requests = 1;
  ip.block_table_stride = num_blocks;
  ip.index_cache = d_idx.as<uint8_t>();
  ip.geometry = ig;
  ip.topk = cfg.topk;
  ip.max_keys = T;
  ip.topk_slots = d_topk.as<int32_t>();
  // Room for every token's scores (one pass) up to 8 GiB, so the halves can be timed alone.
  const int64_t ws_bytes = std::max(indexer_min_workspace_bytes(ip), std::min<int64_t>(T * T * 4, int64_t{8} << 30));
  const int64_t per_pass = std::min<int64_t>({ws_bytes / (T * 4), int64_t{65535}, T});
  Dev d_ws(ws_bytes);
  double pairs = 0.0, keys = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    pairs += double(t + 1);
    keys += double(std::min<int64_t>(t + 1, cfg.topk));
  }
  const double idx_flop = 2.0 * pairs * Hi * 128;
  const double idx_bytes = double(T) * Hi * (128 + 8) + double(T) * (12 + kIndexerSlotBytes) + double(T) * cfg.topk * 4;
  auto add_row = [&](std::string name, double ms, double flop, double peak, std::string peak_name, double bytes) {
    ConsumerBenchRow r;
    r.name = std::move(name);
    r.ms = ms;
    r.tflops = flop / (ms * 1e-3) / 1e12;
    r.peak_tflops = peak;
    r.peak_name = std::move(peak_name);
    r.tbps = bytes / (ms * 1e-3) / 1e12;
    res.rows.push_back(r);
    return r;
  };
  float* ws = d_ws.as<float>();
  for (size_t i = 0; i < cfg.indexers.size(); ++i) {
    ip.logit = cfg.indexers[i];
    const bool exact = ip.logit == IndexerLogit::kExact;
    const double peak = exact ? dmma_peak : res.fp32_tflops;
    const std::string peak_name = exact ? "fp64 tensor" : "fp32 FMA";
    const std::string label = exact ? "indexer exact (fp64 DMMA scores)" : "indexer fp32_tree (CUDA-core scores)";
    const double ms = time_ms([&] { indexer(ip, d_ws.p, ws_bytes, s); }, cfg.repeats, s);
    const ConsumerBenchRow full = add_row(label + " + top-k", ms, idx_flop, peak, peak_name, idx_bytes);
    const double sms = time_ms(
        [&] {
          for (int64_t tok0 = 0; tok0 < T; tok0 += per_pass) indexer_scores(ip, tok0, std::min(per_pass, T - tok0), ws, s);
        },
        cfg.repeats, s);
    add_row("  scores only", sms, idx_flop, peak, peak_name, idx_bytes - double(T) * cfg.topk * 4);
    if (i == 0) {
      res.indexer_ms = full.ms;
      res.indexer_tflops = full.tflops;
      res.indexer_tbps = full.tbps;
    }
  }
  if (per_pass == T) {  // every score is in ws: the top-k alone
    const double tms = time_ms([&] { indexer_topk(ip, 0, T, ws, s); }, cfg.repeats, s);
    add_row("top-k alone (radix select + sort, from stored scores)", tms, 0.0, 0.0, "-",
            double(T) * cfg.topk * 4 + pairs * 4);
  }
  // The selection the attention reads: the first indexer's.
  if (!cfg.indexers.empty() && cfg.indexers.size() > 1) {
    ip.logit = cfg.indexers[0];
    indexer(ip, d_ws.p, ws_bytes, s);
  }

  // ---- attention over the indexer's selection ----
  Dev d_out(size_t(T) * Hq * 512 * 4), d_lse(size_t(T) * Hq * 4);
  SparseMlaParams ap;
  ap.num_tokens = T;
  ap.num_heads = Hq;
  ap.q = d_q.as<uint16_t>();
  ap.mla_cache = d_mla.as<uint8_t>();
  ap.geometry = mg;
  ap.fmt = fmt;
  ap.indices = d_topk.as<int32_t>();
  ap.topk = cfg.topk;
  ap.softmax_scale = sparse_mla_softmax_scale(model.softmax_scale());
  ap.out = d_out.as<float>();
  ap.lse = d_lse.as<float>();
  const double att_flop = 2.0 * keys * Hq * (576.0 + 512.0);
  const double row = static_cast<double>(mla_row_bytes(fmt.kv_format));
  const double att_bytes = double(T) * Hq * (576 * 2 + 512 * 4 + 4) + double(T) * cfg.topk * 4 + double(T) * row;
  for (size_t i = 0; i < cfg.attentions.size(); ++i) {
    const SparseMlaKernel k = cfg.attentions[i];
    const bool mma = k == SparseMlaKernel::kMma;
    const double ms = time_ms([&] { sparse_mla(ap, s, k); }, cfg.repeats, s);
    const ConsumerBenchRow r =
        add_row(mma ? "sparse MLA mma (bf16 tensor cores)" : "sparse MLA simt (fp32 CUDA cores)", ms, att_flop,
                mma ? bf16_peak : res.fp32_tflops, mma ? "bf16 tensor" : "fp32 FMA", att_bytes);
    if (i == 0) {
      res.attention_ms = r.ms;
      res.attention_tflops = r.tflops;
      res.attention_tbps = r.tbps;
      const int heads_per_cta = mma ? 64 : 16;
      res.attention_gathered_tbps =
          keys * row * ((Hq + heads_per_cta - 1) / heads_per_cta) / (r.ms * 1e-3) / 1e12;
    }
  }
  check_cuda(cudaStreamSynchronize(s), "bench");
  cudaStreamDestroy(s);
  return res;
}

}  // namespace pcpkv::cuda
