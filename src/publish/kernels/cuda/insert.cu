// The collect path's quantize-and-insert kernels (SPEC section 5, "collect"), as engines run them after the
// all-gathers: one for the MLA cache (vLLM's concat_and_cache_mla) and one for the indexer-K cache
// (indexer_k_quant_and_cache). They encode from the gathered bf16 values; bytes equal insert_reference's.
//   MLA:     one warp per token; lane l holds kv_c leaves l and l + 32 (tiles l/16 and 2 + l/16 of
//            fp8_ds_mla), lanes 0..7 the k_pe leaves.
//   indexer: one half-warp per token; lane l holds leaf l of the 128 values.
#include <algorithm>
#include <cstring>

#include "core/cuda/check.h"
#include "core/cuda/device.h"
#include "publish/kernels/cuda/kernel_util.cuh"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/validate.h"

namespace pcpkv::cuda {
namespace {

constexpr int kMaxJobs = 8;
constexpr int kThreads = 256;

struct InsertJobArgs {
  const uint16_t* kv_c;
  const uint16_t* k_pe;
  const uint16_t* index_k;
  const int64_t* slot_mapping;  // the MLA kernel's slots; the indexer kernel's too unless the job has its own
  uint8_t* mla_base;
  int64_t row_stride, block_stride;
  uint8_t* index_base;
  int64_t index_block_stride, index_scale_base;
  int32_t block_shift, block_mask, index_block_shift, index_block_mask;
  int64_t token_begin;
};

struct InsertArgs {
  int32_t num_jobs;
  int32_t store_align;
  float k_scale;
  bool pow2;
  int64_t total_tokens;
  InsertJobArgs j[kMaxJobs];
};
static_assert(sizeof(InsertArgs) <= 4096, "kernel parameters must fit the classic 4 KB limit");

__device__ __forceinline__ const InsertJobArgs& job_of(const InsertArgs& a, int64_t g) {
  int jn = 0;
  while (jn + 1 < a.num_jobs && g >= a.j[jn + 1].token_begin) ++jn;
  return a.j[jn];
}

/// bf16 -> fp32 -> bf16 (canonicalizes NaN payloads exactly as insert_reference's round trip does).
__device__ __forceinline__ void bf16_roundtrip(const uint4& v, uint32_t (&w)[4]) {
  float x[8];
  unpack_bf16x8(v, x);
  pack_bf16x8(x, w);
}

template <KvFormat F>
__global__ void __launch_bounds__(kThreads) insert_mla_kernel(const __grid_constant__ InsertArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t{gridDim.x} * (kThreads / 32);
  for (int64_t g = int64_t{blockIdx.x} * (kThreads / 32) + (threadIdx.x >> 5); g < a.total_tokens; g += warps) {
    const InsertJobArgs& j = job_of(a, g);
    const int64_t t = g - j.token_begin;
    const int64_t slot = __ldg(j.slot_mapping + t);
    if (slot < 0) continue;
    const uint4* kv = reinterpret_cast<const uint4*>(j.kv_c + t * kKvLoraRank);
    const uint4 v0 = __ldg(kv + lane), v1 = __ldg(kv + lane + 32);
    uint4 pe = make_uint4(0, 0, 0, 0);
    if (lane < 8) pe = __ldg(reinterpret_cast<const uint4*>(j.k_pe + t * kRopeDims) + lane);
    uint8_t* row = j.mla_base + (slot >> j.block_shift) * j.block_stride + (slot & j.block_mask) * j.row_stride;
    const int sa = a.store_align;
    if constexpr (F == KvFormat::kBf16) {
      uint32_t w[4];
      bf16_roundtrip(v0, w);
      store_bytes<16>(row + 16 * lane, w, sa);
      bf16_roundtrip(v1, w);
      store_bytes<16>(row + 16 * (lane + 32), w, sa);
      if (lane < 8) {
        bf16_roundtrip(pe, w);
        store_bytes<16>(row + 1024 + 16 * lane, w, sa);
      }
    } else if constexpr (F == KvFormat::kFp8) {
      float x[8];
      uint32_t w[2];
      unpack_bf16x8(v0, x);
      divide_by_scale(x, a.k_scale);
      pack_e4m3x8(x, w);
      store_bytes<8>(row + 8 * lane, w, sa);
      unpack_bf16x8(v1, x);
      divide_by_scale(x, a.k_scale);
      pack_e4m3x8(x, w);
      store_bytes<8>(row + 8 * (lane + 32), w, sa);
      if (lane < 8) {
        unpack_bf16x8(pe, x);
        divide_by_scale(x, a.k_scale);
        pack_e4m3x8(x, w);
        store_bytes<8>(row + 512 + 8 * lane, w, sa);
      }
    } else {
      float x0[8], x1[8];
      unpack_bf16x8(v0, x0);
      unpack_bf16x8(v1, x1);
      // Lanes 0..15 / 16..31 hold tiles 0 / 1 (first leaf) and 2 / 3 (second leaf).
      const float s0 = codec::ds_mla_tile_scale(lanes_max<16>(amax8(x0), 0xffffffffu), a.pow2);
      const float s1 = codec::ds_mla_tile_scale(lanes_max<16>(amax8(x1), 0xffffffffu), a.pow2);
      uint32_t w[2];
      divide_by_scale(x0, s0);
      pack_e4m3x8(x0, w);
      store_bytes<8>(row + 8 * lane, w, sa);
      divide_by_scale(x1, s1);
      pack_e4m3x8(x1, w);
      store_bytes<8>(row + 8 * (lane + 32), w, sa);
      if ((lane & 15) == 0) {
        const uint32_t b0 = __float_as_uint(s0), b1 = __float_as_uint(s1);
        store_bytes<4>(row + kDsMlaScaleOffset + 4 * (lane >> 4), &b0, sa);
        store_bytes<4>(row + kDsMlaScaleOffset + 4 * (2 + (lane >> 4)), &b1, sa);
      }
      if (lane < 8) {
        uint32_t wp[4];
        bf16_roundtrip(pe, wp);
        store_bytes<16>(row + kDsMlaKpeOffset + 16 * lane, wp, sa);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) insert_indexer_kernel(const __grid_constant__ InsertArgs a) {
  const int lane = threadIdx.x & 31, half = lane >> 4, l16 = lane & 15;
  const unsigned mask = 0xffffu << (16 * half);
  const int64_t halves = int64_t{gridDim.x} * (kThreads / 16);
  for (int64_t g = int64_t{blockIdx.x} * (kThreads / 16) + (threadIdx.x >> 4); g < a.total_tokens; g += halves) {
    const InsertJobArgs& j = job_of(a, g);
    const int64_t t = g - j.token_begin;
    const int64_t slot = __ldg(j.slot_mapping + t);
    if (slot < 0) continue;  // uniform within the half-warp
    float x[8];
    unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(j.index_k + t * kIndexHeadDim) + l16), x);
    const float s = codec::indexer_scale(lanes_max<16>(amax8(x), mask));
    divide_by_scale(x, s);
    uint32_t w[2];
    pack_e4m3x8(x, w);
    const int64_t blk = slot >> j.index_block_shift, off = slot & j.index_block_mask;
    uint8_t* block = j.index_base + blk * j.index_block_stride;
    store_bytes<8>(block + off * kIndexHeadDim + 8 * l16, w, a.store_align);
    if (l16 == 0) {
      const uint32_t b = __float_as_uint(s);
      store_bytes<4>(block + j.index_scale_base + off * 4, &b, a.store_align);
    }
  }
}

uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

enum class Part { kMla, kIndexer };

void launch_insert(const InsertParams* jobs, int num_jobs, cudaStream_t stream, Part part) {
  for (int i = 0; i < num_jobs; ++i) {
    validate_insert_shape(jobs[i]);
    const InsertParams& p = jobs[i];
    PCPKV_CHECK(addr(p.kv_c) % 16 == 0 && addr(p.k_pe) % 16 == 0 && addr(p.index_k) % 16 == 0,
                "insert: job {}: kv_c / k_pe / index_k must be 16-byte aligned", i);
    PCPKV_CHECK(p.fmt.kv_format == jobs[0].fmt.kv_format && p.fmt.ds_mla_scale == jobs[0].fmt.ds_mla_scale &&
                    p.fmt.k_scale == jobs[0].fmt.k_scale,
                "insert: job {}: every job of one launch must share the cache format", i);
  }
  validate_insert_jobs(jobs, num_jobs);
  for (int first = 0; first < num_jobs; first += kMaxJobs) {
    const int n = std::min(kMaxJobs, num_jobs - first);
    InsertArgs a;
    std::memset(&a, 0, sizeof(a));
    const CacheFormat& fmt = jobs[first].fmt;
    a.k_scale = fmt.k_scale;
    a.pow2 = fmt.ds_mla_scale == DsMlaScale::kPow2;
    uint64_t bits = 0;
    int64_t begin = 0;
    int used = 0;
    for (int k = 0; k < n; ++k) {
      const InsertParams& p = jobs[first + k];
      if (part == Part::kIndexer && !p.fmt.has_indexer) continue;
      InsertJobArgs& j = a.j[used++];
      j.kv_c = p.kv_c;
      j.k_pe = p.k_pe;
      j.index_k = p.index_k;
      // The indexer kernel reads the job's indexer mapping when it has one: same kernel, same loads.
      j.slot_mapping =
          part == Part::kIndexer && p.indexer_slot_mapping != nullptr ? p.indexer_slot_mapping : p.slot_mapping;
      if (part == Part::kMla) {
        j.mla_base = p.target.mla_base;
        j.row_stride = p.target.mla.row_stride;
        j.block_stride = p.target.mla.block_stride;
        j.block_shift = __builtin_ctz(static_cast<unsigned>(p.target.mla.block_size));
        j.block_mask = p.target.mla.block_size - 1;
        bits |= addr(j.mla_base) | static_cast<uint64_t>(j.row_stride) | static_cast<uint64_t>(j.block_stride);
      } else {
        j.index_base = p.target.index_base;
        j.index_block_stride = p.target.index.block_stride;
        j.index_scale_base = int64_t{p.target.index.block_size} * kIndexHeadDim;
        j.index_block_shift = __builtin_ctz(static_cast<unsigned>(p.target.index.block_size));
        j.index_block_mask = p.target.index.block_size - 1;
        bits |= addr(j.index_base) | static_cast<uint64_t>(j.index_block_stride);
      }
      j.token_begin = begin;
      begin += p.num_tokens;
    }
    a.num_jobs = used;
    a.total_tokens = begin;
    a.store_align = align_of(bits);
    if (a.total_tokens == 0) continue;
    const int per_block = part == Part::kMla ? kThreads / 32 : kThreads / 16;
    const int64_t want = (a.total_tokens + per_block - 1) / per_block;
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t{num_sms()} * 8)));
    if (part == Part::kIndexer) {
      insert_indexer_kernel<<<grid, kThreads, 0, stream>>>(a);
    } else {
      switch (fmt.kv_format) {
        case KvFormat::kBf16: insert_mla_kernel<KvFormat::kBf16><<<grid, kThreads, 0, stream>>>(a); break;
        case KvFormat::kFp8: insert_mla_kernel<KvFormat::kFp8><<<grid, kThreads, 0, stream>>>(a); break;
        case KvFormat::kFp8DsMla: insert_mla_kernel<KvFormat::kFp8DsMla><<<grid, kThreads, 0, stream>>>(a); break;
      }
    }
    PCPKV_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void launch_insert_mla(const InsertParams* jobs, int num_jobs, cudaStream_t stream) {
  launch_insert(jobs, num_jobs, stream, Part::kMla);
}

void launch_insert_indexer(const InsertParams* jobs, int num_jobs, cudaStream_t stream) {
  launch_insert(jobs, num_jobs, stream, Part::kIndexer);
}

}  // namespace pcpkv::cuda
