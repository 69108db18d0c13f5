// ConsumerKernels on the GPU for host buffers: validate on the host, upload what the params address,
// run the CUDA kernels, download the outputs (attention_check.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "pcpkv/consumers/attention_check.h"
#include "pcpkv/core/error.h"

namespace pcpkv::cuda {

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) PCPKV_FAIL("cuda consumers: {}: {}", what, cudaGetErrorString(e));
}

/// Device allocation owned for the duration of one call.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes) check_cuda(cudaMalloc(&ptr_, bytes), "cudaMalloc");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void upload(const void* host, cudaStream_t s) {
    if (bytes_) check_cuda(cudaMemcpyAsync(ptr_, host, bytes_, cudaMemcpyHostToDevice, s), "upload");
  }
  void download(void* host, cudaStream_t s) const {
    if (bytes_) check_cuda(cudaMemcpyAsync(host, ptr_, bytes_, cudaMemcpyDeviceToHost, s), "download");
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

size_t sz(int64_t n) { return static_cast<size_t>(n); }

class CudaConsumers final : public ConsumerKernels {
 public:
  CudaConsumers(int device_idx, SparseMlaKernel attention) : device_(device_idx), attention_(attention) {
    PCPKV_CHECK(attention == SparseMlaKernel::kMma || attention == SparseMlaKernel::kSimt,
                "cuda consumers: attention kernel must be kMma or kSimt, got {}", static_cast<int>(attention));
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    PCPKV_CHECK(e == cudaSuccess && n > 0, "cuda consumers: no usable CUDA device ({})",
                e == cudaSuccess ? "0 devices visible" : cudaGetErrorString(e));
    PCPKV_CHECK(device_idx >= 0 && device_idx < n, "cuda consumers: device {} is out of range [0, {})", device_idx, n);
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
  }
  ~CudaConsumers() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  std::string name() const override { return "cuda"; }
  SparseMlaArith attention_arith() const override { return arith_of(attention_); }

  void indexer(const IndexerParams& h) override {
    validate_indexer(h);
    if (h.num_tokens == 0) return;
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const int64_t T = h.num_tokens, H = h.num_heads;
    DeviceBuffer q(sz(T * H * 128)), qs(sz(T * H * 4)), w(sz(T * H * 4)), pos(sz(T * 8)), req(sz(T * 4)),
        tables(sz(int64_t{h.num_requests} * h.block_table_stride * 4)), cache(sz(h.geometry.bytes())),
        slots(sz(T * h.topk * 4)), tpos(h.topk_positions ? sz(T * h.topk * 4) : 0),
        scores(h.scores ? sz(T * h.max_keys * 4) : 0);
    q.upload(h.q_fp8, stream_);
    qs.upload(h.q_scale, stream_);
    w.upload(h.weights, stream_);
    pos.upload(h.positions, stream_);
    req.upload(h.request_idx, stream_);
    if (h.num_requests > 0) tables.upload(h.block_tables, stream_);
    cache.upload(h.index_cache, stream_);
    if (h.scores) scores.upload(h.scores, stream_);  // entries the kernel does not write keep their values
    const int64_t ws_bytes =
        std::max(indexer_min_workspace_bytes(h), std::min<int64_t>(T * h.max_keys * 4, int64_t{1} << 30));
    DeviceBuffer ws(sz(ws_bytes));
    IndexerParams d = h;
    d.q_fp8 = q.as<uint8_t>();
    d.q_scale = qs.as<float>();
    d.weights = w.as<float>();
    d.positions = pos.as<int64_t>();
    d.request_idx = req.as<int32_t>();
    d.block_tables = tables.as<int32_t>();
    d.index_cache = cache.as<uint8_t>();
    d.topk_slots = slots.as<int32_t>();
    d.topk_positions = h.topk_positions ? tpos.as<int32_t>() : nullptr;
    d.scores = h.scores ? scores.as<float>() : nullptr;
    cuda::indexer(d, ws.as<void>(), ws_bytes, stream_);
    slots.download(h.topk_slots, stream_);
    if (h.topk_positions) tpos.download(h.topk_positions, stream_);
    if (h.scores) scores.download(h.scores, stream_);
    check_cuda(cudaStreamSynchronize(stream_), "indexer");
  }

  void sparse_mla(const SparseMlaParams& h) override {
    validate_sparse_mla(h);
    if (h.num_tokens == 0) return;
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const int64_t T = h.num_tokens, H = h.num_heads;
    DeviceBuffer q(sz(T * H * 576 * 2)), cache(sz(h.geometry.bytes())), idx(sz(T * h.topk * 4)),
        out(sz(T * H * 512 * 4)), lse(sz(T * H * 4));
    q.upload(h.q, stream_);
    cache.upload(h.mla_cache, stream_);
    idx.upload(h.indices, stream_);
    SparseMlaParams d = h;
    d.q = q.as<uint16_t>();
    d.mla_cache = cache.as<uint8_t>();
    d.indices = idx.as<int32_t>();
    d.out = out.as<float>();
    d.lse = lse.as<float>();
    cuda::sparse_mla(d, stream_, attention_);
    out.download(h.out, stream_);
    lse.download(h.lse, stream_);
    check_cuda(cudaStreamSynchronize(stream_), "sparse_mla");
  }

  void lse_merge(const LseMergeParams& h) override {
    validate_lse_merge(h);
    if (h.num_rows == 0) return;
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const int64_t S = h.num_shards, R = h.num_rows, D = h.head_dim;
    DeviceBuffer outs(sz(S * R * D * 4)), lses(sz(S * R * 4)), out(sz(R * D * 4)), lse(sz(R * 4));
    outs.upload(h.outs, stream_);
    lses.upload(h.lses, stream_);
    LseMergeParams d = h;
    d.outs = outs.as<float>();
    d.lses = lses.as<float>();
    d.out = out.as<float>();
    d.lse = lse.as<float>();
    cuda::lse_merge(d, stream_);
    out.download(h.out, stream_);
    lse.download(h.lse, stream_);
    check_cuda(cudaStreamSynchronize(stream_), "lse_merge");
  }

 private:
  int device_ = 0;
  SparseMlaKernel attention_ = SparseMlaKernel::kMma;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<ConsumerKernels> make_consumers(int device_idx, SparseMlaKernel attention) {
  return std::make_unique<CudaConsumers>(device_idx, attention);
}

}  // namespace pcpkv::cuda
