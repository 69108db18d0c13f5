// src/serving/drivers/cuda/allreduce_cuda.cu: the all-reduce over symmetric memory on the GPU
// (pcpkv/serving/allreduce.h): the kernel (one-shot / two-shot, plain / fused residual-add + RMSNorm), W logical ranks
// in one launch, one rank per process with the capability agreement and the NCCL fallback.
//
// The kernel is written against a plain table of every rank's workspace address (peer pointers), so the
// same code serves W logical ranks of one process (grid.y = local rank, all in one launch so that every
// block is resident) and one rank per process (grid.y = 1) over CUDA VMM / IPC mappings.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(PCPKV_HAVE_NCCL)
#include <nccl.h>
#endif

#include "core/cuda/check.h"
#include "pcpkv/serving/allreduce.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/device/ptx_ordering.h"
#include "pcpkv/device/token_math.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/pdl.h"
#include "pcpkv/ranks/symmetric.h"

namespace pcpkv::cuda {
namespace {

constexpr int kThreads = kAllReduceThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxLeavesPerThread = static_cast<int>(kAllReduceMaxHidden / 8 / kThreads);  // 4
constexpr int32_t kDefaultMaxBlocks = 32;

struct ArParams {
  uint8_t* ws[kAllReduceMaxRanks];              // every rank's workspace (this process's addresses)
  const uint16_t* in[kAllReduceMaxRanks];       // per local rank (blockIdx.y)
  uint16_t* out[kAllReduceMaxRanks];            // plain: reduced; fused: y
  const uint16_t* res_in[kAllReduceMaxRanks];
  uint16_t* res_out[kAllReduceMaxRanks];
  const float* norm_w;
  float eps;
  int32_t hidden;
  int32_t leaves_per_thread;  // fused: power of two, 256 * it >= hidden / 8
  int32_t world;
  int32_t rank_base;
  AllReducePartition part;
  int64_t half_bytes;
  int64_t timeout_ns;
};

// ---- memory-model primitives: ptx::st_release_sys / ld_acquire_sys (pcpkv/device/ptx_ordering.h) ----
/// Peer data: written by other ranks during this launch, so never from L1.
__device__ __forceinline__ uint4 ld_peer(const uint16_t* base, int64_t vec) {
  return __ldcg(reinterpret_cast<const uint4*>(base) + vec);
}

__device__ __forceinline__ void unpack(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = static_cast<uint32_t>(codec::float_to_bf16(f[2 * i])) |
           (static_cast<uint32_t>(codec::float_to_bf16(f[2 * i + 1])) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

struct Ctx {
  const ArParams& P;
  int local;
  int rank;
  int blk;
  uint32_t epoch;
  uint32_t parity;

  __device__ uint16_t* data(int r) const {
    return reinterpret_cast<uint16_t*>(P.ws[r] + AllReduceLayout::kHeaderBytes + int64_t{parity} * P.half_bytes);
  }
  __device__ uint16_t* aux(int r) const {
    return reinterpret_cast<uint16_t*>(P.ws[r] + AllReduceLayout::kHeaderBytes + (2 + int64_t{parity}) * P.half_bytes);
  }

  /// Per-block barrier of SPEC section 5's shape: publish the epoch to every peer (release, system
  /// scope), poll the own slots (acquire); bounded, recording the missing peer in the error word.
  __device__ void barrier(int barrier_idx) const {
    __syncthreads();
    const int tid = threadIdx.x;
    if (tid < P.world) {
      uint32_t* remote =
          reinterpret_cast<uint32_t*>(P.ws[tid] + AllReduceLayout::signal_offset(blk, barrier_idx, parity, rank));
      ptx::fence_sys();
      ptx::st_release_sys(remote, epoch);
      const uint32_t* slot =
          reinterpret_cast<const uint32_t*>(P.ws[rank] + AllReduceLayout::signal_offset(blk, barrier_idx, parity, tid));
      const uint64_t start = ptx::globaltimer_ns();
      while (ptx::ld_acquire_sys(slot) != epoch) {
        if (ptx::globaltimer_ns() - start > static_cast<uint64_t>(P.timeout_ns)) {
          atomicCAS(reinterpret_cast<unsigned int*>(P.ws[rank] + AllReduceLayout::kErrorOffset), 0u,
                    static_cast<unsigned int>(tid + 1));
          break;
        }
      }
    }
    __syncthreads();
  }

  /// Sum of vector `vec` over all ranks' data regions, in rank order, fp32; f: 8 floats (not rounded).
  __device__ void reduce_vec(int64_t vec, float* f) const {
    uint4 v[kAllReduceMaxRanks];
#pragma unroll
    for (int r = 0; r < kAllReduceMaxRanks; ++r)
      if (r < P.world) v[r] = ld_peer(data(r), vec);
    unpack(v[0], f);
#pragma unroll
    for (int r = 1; r < kAllReduceMaxRanks; ++r) {
      if (r < P.world) {
        float g[8];
        unpack(v[r], g);
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = fp32::add(f[j], g[j]);
      }
    }
  }

  /// Calls f(item) for every item of this block in segment q (vectors: one per thread; rows: the whole block).
  template <bool kRows, typename F>
  __device__ void for_items(int32_t q, F&& f) const {
    const int64_t begin = P.part.segment_begin(q), end = P.part.segment_end(q);
    const int64_t chunks = P.part.num_chunks(q);
    for (int64_t c = blk; c < chunks; c += P.part.num_blocks) {
      const int64_t i0 = begin + c * P.part.items_per_chunk;
      if constexpr (kRows) {
        f(i0);  // one row per chunk
      } else {
        const int64_t i = i0 + threadIdx.x;
        if (i < end && i < i0 + P.part.items_per_chunk) f(i);
      }
    }
  }
};

/// Block-wide sum in the canonical order of token_math.h: per thread its leaves pairwise, warp butterfly,
/// then the warps pairwise. Every thread returns the same value.
__device__ __forceinline__ float block_canonical_sum(float v, float* smem_warps) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) v = fp32::add(v, __shfl_xor_sync(0xffffffffu, v, off));
  if ((threadIdx.x & 31) == 0) smem_warps[threadIdx.x >> 5] = v;
  __syncthreads();
  float w[kWarps];
#pragma unroll
  for (int i = 0; i < kWarps; ++i) w[i] = smem_warps[i];
#pragma unroll
  for (int h = 1; h < kWarps; h <<= 1)
#pragma unroll
    for (int i = 0; i + h < kWarps; i += 2 * h) w[i] = fp32::add(w[i], w[i + h]);
  __syncthreads();  // smem_warps is reused by the next row
  return w[0];
}

template <bool kTwoShot, bool kFused>
__global__ void __launch_bounds__(kThreads) allreduce_kernel(ArParams P) {
  __shared__ uint32_t s_epoch;
  __shared__ float s_warps[kWarps];
  const int local = blockIdx.y;
  const int rank = P.rank_base + local;
  uint8_t* mine = P.ws[rank];
  pdl::wait();  // the input, the residual and the workspace may belong to the previous kernel
  if (threadIdx.x == 0) s_epoch = *reinterpret_cast<volatile uint32_t*>(mine + AllReduceLayout::kEpochOffset) + 1;
  __syncthreads();
  const Ctx cx{P, local, rank, static_cast<int>(blockIdx.x), s_epoch, s_epoch & 1u};
  const int64_t row_vecs = kFused ? P.hidden / 8 : 1;

  // 1. Copy this block's items of every segment into the own data region.
  for (int32_t q = 0; q < P.part.num_segments; ++q) {
    if constexpr (kFused) {
      cx.for_items<true>(q, [&](int64_t row) {
        const uint4* src = reinterpret_cast<const uint4*>(P.in[local]) + row * row_vecs;
        uint4* dst = reinterpret_cast<uint4*>(cx.data(rank)) + row * row_vecs;
        for (int64_t v = threadIdx.x; v < row_vecs; v += kThreads) dst[v] = src[v];
      });
    } else {
      cx.for_items<false>(q, [&](int64_t v) {
        reinterpret_cast<uint4*>(cx.data(rank))[v] = reinterpret_cast<const uint4*>(P.in[local])[v];
      });
    }
  }
  cx.barrier(0);

  // 2. Reduce the own segment (one-shot: everything).
  const int32_t own = kTwoShot ? rank : 0;
  if constexpr (kFused) {
    cx.for_items<true>(own, [&](int64_t row) {
      float r[kMaxLeavesPerThread][8];
      float leaf_sum[kMaxLeavesPerThread];
      const int k = P.leaves_per_thread;
#pragma unroll
      for (int j = 0; j < kMaxLeavesPerThread; ++j) {
        leaf_sum[j] = 0.0f;
        const int64_t leaf = int64_t{k} * threadIdx.x + j;
        if (j < k && leaf < row_vecs) {
          const int64_t vec = row * row_vecs + leaf;
          float red[8];
          cx.reduce_vec(vec, red);
          float res_in[8];
          unpack(reinterpret_cast<const uint4*>(P.res_in[local])[vec], res_in);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float reduced = codec::bf16_to_float(codec::float_to_bf16(red[e]));
            r[j][e] = codec::bf16_to_float(codec::float_to_bf16(fp32::add(reduced, res_in[e])));
          }
          const uint4 res_packed = pack(r[j]);
          reinterpret_cast<uint4*>(P.res_out[local])[vec] = res_packed;
          if constexpr (kTwoShot) reinterpret_cast<uint4*>(cx.aux(rank))[vec] = res_packed;
          leaf_sum[j] = math::leaf_sumsq(r[j]);
        }
      }
      // Pairwise over this thread's k leaves (an aligned subtree of the canonical tree).
      for (int h = 1; h < k; h <<= 1)
#pragma unroll
        for (int j = 0; j < kMaxLeavesPerThread; ++j)
          if (j + h < k && (j % (2 * h)) == 0) leaf_sum[j] = fp32::add(leaf_sum[j], leaf_sum[j + h]);
      const float sumsq = block_canonical_sum(leaf_sum[0], s_warps);
      const float inv = math::rms_inv(sumsq, P.hidden, P.eps);
#pragma unroll
      for (int j = 0; j < kMaxLeavesPerThread; ++j) {
        const int64_t leaf = int64_t{k} * threadIdx.x + j;
        if (j < k && leaf < row_vecs) {
          const int64_t vec = row * row_vecs + leaf;
          float y[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) y[e] = math::rms_apply(r[j][e], inv, P.norm_w[leaf * 8 + e]);
          const uint4 y_packed = pack(y);
          reinterpret_cast<uint4*>(P.out[local])[vec] = y_packed;
          if constexpr (kTwoShot) reinterpret_cast<uint4*>(cx.data(rank))[vec] = y_packed;
        }
      }
    });
  } else {
    cx.for_items<false>(own, [&](int64_t v) {
      float red[8];
      cx.reduce_vec(v, red);
      const uint4 packed = pack(red);
      reinterpret_cast<uint4*>(P.out[local])[v] = packed;
      if constexpr (kTwoShot) reinterpret_cast<uint4*>(cx.data(rank))[v] = packed;  // own segment: done with it
    });
  }

  // 3. Two-shot: gather the other segments from their owners.
  if constexpr (kTwoShot) {
    cx.barrier(1);
    for (int32_t q = 0; q < P.world; ++q) {
      if (q == rank) continue;
      if constexpr (kFused) {
        cx.for_items<true>(q, [&](int64_t row) {
          for (int64_t v = threadIdx.x; v < row_vecs; v += kThreads) {
            const int64_t vec = row * row_vecs + v;
            reinterpret_cast<uint4*>(P.out[local])[vec] = ld_peer(cx.data(q), vec);
            reinterpret_cast<uint4*>(P.res_out[local])[vec] = ld_peer(cx.aux(q), vec);
          }
        });
      } else {
        cx.for_items<false>(q, [&](int64_t v) { reinterpret_cast<uint4*>(P.out[local])[v] = ld_peer(cx.data(q), v); });
      }
    }
  }

  // No wait follows: the next kernel may launch (it cannot take an SM a spinning block needs).
  pdl::launch_dependents();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* arrivals = reinterpret_cast<unsigned int*>(mine + AllReduceLayout::kArrivalOffset);
    __threadfence();
    if (atomicAdd(arrivals, 1u) == static_cast<unsigned int>(P.part.num_blocks - 1)) {
      *arrivals = 0u;  // the last block of this rank closes the call
      *reinterpret_cast<volatile uint32_t*>(mine + AllReduceLayout::kEpochOffset) = cx.epoch;
      __threadfence();
    }
  }
}

using Kernel = void (*)(ArParams);
Kernel pick_kernel(bool two_shot, bool fused) {
  if (two_shot) return fused ? allreduce_kernel<true, true> : allreduce_kernel<true, false>;
  return fused ? allreduce_kernel<false, true> : allreduce_kernel<false, false>;
}

int32_t leaves_per_thread(int64_t hidden) {
  const int64_t need = (hidden / 8 + kThreads - 1) / kThreads;
  int32_t k = 1;
  while (k < need) k *= 2;
  return k;
}

/// Fills the partition and block count of a call and launches it for num_local ranks starting at rank_base.
void launch(ArParams& P, int32_t num_local, int64_t num_elems, bool fused, const AllReduceOptions& o,
            int32_t max_blocks, CUstream_st* stream) {
  AllReduceAlgo algo = o.algo == AllReduceAlgo::kAuto ? choose_allreduce_algo(num_elems * 2, P.world, fused) : o.algo;
  const bool two_shot = algo == AllReduceAlgo::kTwoShot;
  P.part.num_items = fused ? num_elems / P.hidden : num_elems / 8;
  P.part.items_per_chunk = fused ? 1 : kAllReduceChunkVectors;
  P.part.num_segments = two_shot ? P.world : 1;
  P.part.num_blocks = o.num_blocks > 0 ? o.num_blocks : allreduce_num_blocks(P.part, max_blocks);
  PCPKV_CHECK(P.part.num_blocks >= 1 && P.part.num_blocks <= max_blocks,
              "all-reduce: num_blocks = {} is outside [1, {}] (every block of every rank must be resident)",
              P.part.num_blocks, max_blocks);
  PCPKV_CHECK(o.timeout_ns > 0, "all-reduce: timeout_ns = {} must be > 0", o.timeout_ns);
  P.timeout_ns = o.timeout_ns;
  PCPKV_CUDA_CHECK(pdl::launch(pick_kernel(two_shot, fused), dim3(static_cast<unsigned>(P.part.num_blocks),
                                                                   static_cast<unsigned>(num_local)),
                               dim3(kThreads), 0, stream, o.pdl, P));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

void check_buffers(const void* in, const void* out, int64_t n) {
  if (n == 0) return;
  PCPKV_CHECK(in != nullptr && out != nullptr, "all-reduce: null in or out pointer");
  PCPKV_CHECK(aligned16(in) && aligned16(out), "all-reduce: in and out must be 16-byte aligned");
}

void set_norm(ArParams& P, const AllReduceNorm& norm) {
  P.norm_w = norm.weight;
  P.eps = norm.eps;
  P.hidden = static_cast<int32_t>(norm.hidden);
  P.leaves_per_thread = leaves_per_thread(norm.hidden);
}

/// Reads and clears an error word; throws FenceTimeout when set.
void check_error_word(uint8_t* ws, int32_t rank) {
  uint32_t err = 0;
  PCPKV_CUDA_CHECK(cudaMemcpy(&err, ws + AllReduceLayout::kErrorOffset, 4, cudaMemcpyDeviceToHost));
  if (err != 0) {
    const uint32_t zero = 0;
    PCPKV_CUDA_CHECK(cudaMemcpy(ws + AllReduceLayout::kErrorOffset, &zero, 4, cudaMemcpyHostToDevice));
    throw FenceTimeout(fmt::format("all-reduce: rank {} gave up waiting for rank {} (bound exceeded); the workspaces "
                                   "must be re-created",
                                   rank, err - 1),
                       static_cast<int>(err - 1), fmt::format("{}:{}", __FILE__, __LINE__));
  }
}

int32_t resident_blocks_per_sm() {
  int device = 0, per_sm = 0, min_per_sm = 1 << 30;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  for (const bool two : {false, true})
    for (const bool fused : {false, true}) {
      PCPKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, pick_kernel(two, fused), kThreads, 0));
      min_per_sm = std::min(min_per_sm, per_sm);
    }
  return min_per_sm;
}

}  // namespace

// ---- W logical ranks on one GPU ------------------------------------------------------------------

struct LogicalAllReduce::Impl {
  int32_t world = 0;
  AllReduceLayout layout;
  uint8_t* base = nullptr;
  int32_t max_blocks = 0;
  ~Impl() {
    if (base) cudaFree(base);
  }
};

LogicalAllReduce::LogicalAllReduce(int32_t world_size, int64_t max_elems) : impl_(new Impl) {
  PCPKV_CHECK(world_size >= 1 && world_size <= kAllReduceMaxRanks, "all-reduce: world_size = {} is outside [1, {}]",
              world_size, kAllReduceMaxRanks);
  PCPKV_CHECK(max_elems >= 8, "all-reduce: max_elems = {} must be >= 8", max_elems);
  impl_->world = world_size;
  impl_->layout.max_elems = max_elems;
  const size_t bytes = static_cast<size_t>(impl_->layout.bytes()) * world_size;
  PCPKV_CUDA_CHECK(cudaMalloc(&impl_->base, bytes));
  PCPKV_CUDA_CHECK(cudaMemset(impl_->base, 0, bytes));
  int device = 0, sms = 0;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  PCPKV_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Every block of every rank must be resident at once (they wait for each other); keep a margin of one
  // block per SM for whatever else runs.
  const int32_t capacity = std::max(1, sms * std::max(1, resident_blocks_per_sm() - 1));
  impl_->max_blocks = std::max(1, std::min<int32_t>(kAllReduceMaxBlocks, capacity / world_size));
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
}

LogicalAllReduce::~LogicalAllReduce() = default;
int32_t LogicalAllReduce::world_size() const { return impl_->world; }
const AllReduceLayout& LogicalAllReduce::layout() const { return impl_->layout; }
uint8_t* LogicalAllReduce::workspace(int32_t r) const {
  PCPKV_CHECK(r >= 0 && r < impl_->world, "all-reduce: rank {} is outside [0, {})", r, impl_->world);
  return impl_->base + static_cast<size_t>(impl_->layout.bytes()) * r;
}
int32_t LogicalAllReduce::max_blocks() const { return impl_->max_blocks; }

void LogicalAllReduce::run(const uint16_t* const* in, uint16_t* const* out, int64_t n, CUstream_st* stream,
                           const AllReduceOptions& options) {
  validate_allreduce(impl_->world, 0, impl_->layout, n, false, {});
  if (n == 0) return;
  ArParams P{};
  P.world = impl_->world;
  P.rank_base = 0;
  P.half_bytes = impl_->layout.half_bytes();
  for (int32_t r = 0; r < impl_->world; ++r) {
    check_buffers(in[r], out[r], n);
    P.ws[r] = workspace(r);
    P.in[r] = in[r];
    P.out[r] = out[r];
  }
  launch(P, impl_->world, n, false, options, impl_->max_blocks, stream);
}

void LogicalAllReduce::run_fused(const uint16_t* const* in, const uint16_t* const* residual_in,
                                 uint16_t* const* residual_out, uint16_t* const* y, int64_t num_tokens,
                                 const AllReduceNorm& norm, CUstream_st* stream, const AllReduceOptions& options) {
  PCPKV_CHECK(num_tokens >= 0, "all-reduce: num_tokens = {} must be >= 0", num_tokens);
  const int64_t n = num_tokens * norm.hidden;
  validate_allreduce(impl_->world, 0, impl_->layout, n, true, norm);
  if (n == 0) return;
  ArParams P{};
  P.world = impl_->world;
  P.rank_base = 0;
  P.half_bytes = impl_->layout.half_bytes();
  set_norm(P, norm);
  for (int32_t r = 0; r < impl_->world; ++r) {
    check_buffers(in[r], y[r], n);
    check_buffers(residual_in[r], residual_out[r], n);
    P.ws[r] = workspace(r);
    P.in[r] = in[r];
    P.out[r] = y[r];
    P.res_in[r] = residual_in[r];
    P.res_out[r] = residual_out[r];
  }
  launch(P, impl_->world, n, true, options, impl_->max_blocks, stream);
}

void LogicalAllReduce::check() {
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  for (int32_t r = 0; r < impl_->world; ++r) check_error_word(workspace(r), r);
}

// ---- one rank per process ------------------------------------------------------------------------

bool allreduce_local_capability(const std::vector<uint8_t*>& workspaces, std::string* why) {
  auto fail = [&](std::string s) {
    if (why) *why = std::move(s);
    return false;
  };
  if (workspaces.empty() || workspaces.size() > static_cast<size_t>(kAllReduceMaxRanks))
    return fail(fmt::format("world size {} is outside [1, {}]", workspaces.size(), kAllReduceMaxRanks));
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return fail("no current CUDA device");
  for (size_t r = 0; r < workspaces.size(); ++r) {
    if (workspaces[r] == nullptr) return fail(fmt::format("rank {}'s workspace is not mapped", r));
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, workspaces[r]) != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
      cudaGetLastError();
      return fail(fmt::format("rank {}'s workspace {} is not device memory", r, static_cast<void*>(workspaces[r])));
    }
    if (attr.device != device) {
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, device, attr.device) != cudaSuccess || !can)
        return fail(fmt::format("device {} cannot access rank {}'s device {} (no P2P)", device, r, attr.device));
    }
  }
  if (why) why->clear();
  return true;
}

struct AllReduce::Impl {
  int32_t rank = 0;
  int32_t world = 0;
  std::vector<uint8_t*> ws;
  AllReduceLayout layout;
  bool symmetric = false;
  std::string reason;
  ncclComm* nccl = nullptr;
  uint8_t* private_ws = nullptr;  // fallback: a one-rank workspace for the local add + RMSNorm
  ~Impl() {
    if (private_ws) cudaFree(private_ws);
  }
};

AllReduce::AllReduce(int32_t rank, const std::vector<uint8_t*>& workspaces, int64_t max_elems,
                     const AllRanksAnd& all_ranks, ncclComm* nccl)
    : impl_(new Impl) {
  const auto world = static_cast<int32_t>(workspaces.size());
  PCPKV_CHECK(world >= 1 && world <= kAllReduceMaxRanks, "all-reduce: world size {} is outside [1, {}]", world,
              kAllReduceMaxRanks);
  PCPKV_CHECK(rank >= 0 && rank < world, "all-reduce: rank = {} is outside [0, {})", rank, world);
  PCPKV_CHECK(max_elems >= 8, "all-reduce: max_elems = {} must be >= 8", max_elems);
  Impl& m = *impl_;
  m.rank = rank;
  m.world = world;
  m.ws = workspaces;
  m.layout.max_elems = max_elems;
  m.nccl = nccl;
  std::string why;
  const bool local_ok = allreduce_local_capability(workspaces, &why);
  if (local_ok) {  // zero the own header before anyone can signal into it: the agreement below is the barrier
    PCPKV_CUDA_CHECK(cudaMemset(workspaces[rank], 0, AllReduceLayout::kHeaderBytes));
    PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  }
  m.symmetric = agree_capability(local_ok, all_ranks);
  if (m.symmetric) return;
  m.reason = local_ok ? "another rank cannot use symmetric memory" : fmt::format("rank {}: {}", rank, why);
#if defined(PCPKV_HAVE_NCCL)
  PCPKV_CHECK(nccl != nullptr, "all-reduce: symmetric memory unusable ({}) and no NCCL communicator was given",
              m.reason);
  AllReduceLayout one;
  one.max_elems = max_elems;
  PCPKV_CUDA_CHECK(cudaMalloc(&m.private_ws, one.bytes()));
  PCPKV_CUDA_CHECK(cudaMemset(m.private_ws, 0, one.bytes()));
#else
  PCPKV_FAIL("all-reduce: symmetric memory unusable ({}) and pcpkv was built without NCCL for the fallback", m.reason);
#endif
}

namespace {
const std::vector<uint8_t*>& checked_ptrs(const SymmetricMemory& m, int64_t max_elems) {
  AllReduceLayout layout;
  layout.max_elems = max_elems;
  PCPKV_CHECK(m.on_device(), "all-reduce: symmetric memory '{}' is host memory; the GPU all-reduce needs device memory",
              m.name());
  PCPKV_CHECK(m.bytes() >= layout.bytes(), "all-reduce: symmetric memory '{}' has {} bytes per rank, the layout for "
              "max_elems = {} needs {}", m.name(), m.bytes(), max_elems, layout.bytes());
  return m.ptrs();
}
}  // namespace

AllReduce::AllReduce(const SymmetricMemory& workspaces, Bootstrap& group, int64_t max_elems, ncclComm* nccl)
    : AllReduce(workspaces.rank(), checked_ptrs(workspaces, max_elems), max_elems, all_ranks_and(group), nccl) {}

AllReduce::~AllReduce() = default;
bool AllReduce::uses_symmetric_memory() const { return impl_->symmetric; }
const std::string& AllReduce::fallback_reason() const { return impl_->reason; }
const AllReduceLayout& AllReduce::layout() const { return impl_->layout; }

namespace {
#if defined(PCPKV_HAVE_NCCL)
void nccl_sum(const uint16_t* in, uint16_t* out, int64_t n, ncclComm* comm, CUstream_st* stream) {
  const ncclResult_t r = ncclAllReduce(in, out, static_cast<size_t>(n), ncclBfloat16, ncclSum, comm, stream);
  PCPKV_CHECK(r == ncclSuccess, "all-reduce: ncclAllReduce failed: {}", ncclGetErrorString(r));
}
#endif
}  // namespace

void AllReduce::run(const uint16_t* in, uint16_t* out, int64_t n, CUstream_st* stream, const AllReduceOptions& options) {
  Impl& m = *impl_;
  validate_allreduce(m.world, m.rank, m.layout, n, false, {});
  if (n == 0) return;
  check_buffers(in, out, n);
  if (!m.symmetric) {
#if defined(PCPKV_HAVE_NCCL)
    nccl_sum(in, out, n, m.nccl, stream);
#endif
    return;
  }
  ArParams P{};
  P.world = m.world;
  P.rank_base = m.rank;
  P.half_bytes = m.layout.half_bytes();
  for (int32_t r = 0; r < m.world; ++r) P.ws[r] = m.ws[r];
  P.in[0] = in;
  P.out[0] = out;
  launch(P, 1, n, false, options, kDefaultMaxBlocks, stream);
}

void AllReduce::run_fused(const uint16_t* in, const uint16_t* residual_in, uint16_t* residual_out, uint16_t* y,
                          int64_t num_tokens, const AllReduceNorm& norm, CUstream_st* stream,
                          const AllReduceOptions& options) {
  Impl& m = *impl_;
  PCPKV_CHECK(num_tokens >= 0, "all-reduce: num_tokens = {} must be >= 0", num_tokens);
  const int64_t n = num_tokens * norm.hidden;
  validate_allreduce(m.world, m.rank, m.layout, n, true, norm);
  if (n == 0) return;
  check_buffers(in, y, n);
  check_buffers(residual_in, residual_out, n);
  ArParams P{};
  P.half_bytes = m.layout.half_bytes();
  set_norm(P, norm);
  P.res_in[0] = residual_in;
  P.res_out[0] = residual_out;
  P.out[0] = y;
  if (m.symmetric) {
    P.world = m.world;
    P.rank_base = m.rank;
    for (int32_t r = 0; r < m.world; ++r) P.ws[r] = m.ws[r];
    P.in[0] = in;
    launch(P, 1, n, true, options, kDefaultMaxBlocks, stream);
    return;
  }
#if defined(PCPKV_HAVE_NCCL)
  // NCCL sums into y, then the one-rank kernel adds the residual and normalizes (reads y before writing it).
  nccl_sum(in, y, n, m.nccl, stream);
  P.world = 1;
  P.rank_base = 0;
  P.ws[0] = m.private_ws;
  P.in[0] = y;
  AllReduceOptions one = options;
  one.algo = AllReduceAlgo::kOneShot;
  launch(P, 1, n, true, one, kDefaultMaxBlocks, stream);
#endif
}

void AllReduce::check() {
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  if (impl_->symmetric) check_error_word(impl_->ws[impl_->rank], impl_->rank);
}

}  // namespace pcpkv::cuda
