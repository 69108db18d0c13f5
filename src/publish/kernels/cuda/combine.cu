// The staging combine (SPEC section 5): rank-major transport rows of one staging half -> the local paged
// caches. A pure copy (bytes equal combine_reference's): 16-byte chunks, the MLA row first, then the indexer data
// and the 4-byte indexer scale. Rows whose gathered slot is -1 (padding, decode copies of ranks > 0) are
// skipped, so decode rows land once, from rank 0. With a gathered indexer slot mapping (CombineParams) a row's
// indexer part goes to its own slot, each -1 skipping its own cache (loaded only then). Two kernels:
//   rows_per_warp 1 (the first one): one warp per row; the slot is read first, the row only when it is >= 0
//     (two dependent memory latencies per row);
//   rows_per_warp 2 / 4 (batched): a warp reads the slots AND the rows of 2 or 4 consecutive rows at once
//     (rows are read even when their slot is -1: they exist in the staging buffer, and padding is rare),
//     then stores those with a slot (evict-first row stores): one memory latency per batch and 2-4x the
//     bytes in flight.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "core/cuda/check.h"
#include "core/cuda/device.h"
#include "publish/kernels/cuda/kernel_util.cuh"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/validate.h"
#include "pcpkv/core/pdl.h"

namespace pcpkv::cuda {
namespace {

constexpr int kMaxJobs = 8;
constexpr int kThreads = 256;
constexpr int kMaxChunkIters = 3;  // up to 96 chunks of 16 B per row (bf16 + indexer = 80)

struct CombineJobArgs {
  const uint8_t* rows;
  const int64_t* slot_mapping;
  const int64_t* indexer_slot_mapping;  // null: slot_mapping's
  uint8_t* mla_base;
  int64_t row_stride, block_stride;
  uint8_t* index_base;
  int64_t index_block_stride, index_scale_base;
  int32_t block_shift, block_mask, index_block_shift, index_block_mask;
  int64_t row_begin;  // first work row of this job
};

struct CombineArgs {
  int32_t num_jobs;
  int32_t mla_chunks;      // mla_bytes / 16
  int32_t num_chunks;      // mla_chunks (+ 8 indexer data chunks)
  int32_t store_align;
  int64_t row_bytes;
  int64_t index_data_offset, index_scale_offset;
  bool has_indexer;
  int64_t total_rows;
  CombineJobArgs j[kMaxJobs];
};
static_assert(sizeof(CombineArgs) <= 4096, "kernel parameters must fit the classic 4 KB limit");

__global__ void __launch_bounds__(kThreads) combine_kernel(const __grid_constant__ CombineArgs a) {
  pdl::wait();  // PDL: the staging rows are the previous kernels' output
  pdl::launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t{gridDim.x} * (kThreads / 32);
  for (int64_t g = int64_t{blockIdx.x} * (kThreads / 32) + (threadIdx.x >> 5); g < a.total_rows; g += warps) {
    int jn = 0;
    while (jn + 1 < a.num_jobs && g >= a.j[jn + 1].row_begin) ++jn;
    const CombineJobArgs& j = a.j[jn];
    const int64_t i = g - j.row_begin;
    const int64_t slot = __ldg(j.slot_mapping + i);
    const int64_t islot = j.indexer_slot_mapping != nullptr ? __ldg(j.indexer_slot_mapping + i) : slot;
    if (slot < 0 && islot < 0) continue;
    const uint8_t* row = j.rows + i * a.row_bytes;
    // All loads of the row first, then the stores.
    uint4 v[kMaxChunkIters];
#pragma unroll
    for (int k = 0; k < kMaxChunkIters; ++k) {
      const int c = lane + 32 * k;
      if (c < a.num_chunks) {
        const int64_t src = c < a.mla_chunks ? 16 * c : a.index_data_offset + 16 * (c - a.mla_chunks);
        v[k] = __ldg(reinterpret_cast<const uint4*>(row + src));
      }
    }
    uint32_t scale = 0;
    if (a.has_indexer && lane == 31) scale = __ldg(reinterpret_cast<const uint32_t*>(row + a.index_scale_offset));
    uint8_t* mla = j.mla_base + (slot >> j.block_shift) * j.block_stride + (slot & j.block_mask) * j.row_stride;
    const int64_t iblk = islot >> j.index_block_shift, ioff = islot & j.index_block_mask;
    uint8_t* iblock = j.index_base + iblk * j.index_block_stride;
#pragma unroll
    for (int k = 0; k < kMaxChunkIters; ++k) {
      const int c = lane + 32 * k;
      if (c < a.num_chunks && (c < a.mla_chunks ? slot : islot) >= 0) {
        uint8_t* dst = c < a.mla_chunks ? mla + 16 * c : iblock + ioff * kIndexHeadDim + 16 * (c - a.mla_chunks);
        const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
        store_bytes<16>(dst, w, a.store_align);
      }
    }
    if (a.has_indexer && lane == 31 && islot >= 0)
      store_bytes<4>(iblock + j.index_scale_base + ioff * 4, &scale, a.store_align);
  }
}

/// Batched: a warp copies kRows consecutive rows per iteration; kIters 16-byte chunks per lane cover a row.
template <int kRows, int kIters>
__global__ void __launch_bounds__(kThreads) combine_rows_kernel(const __grid_constant__ CombineArgs a) {
  pdl::wait();  // PDL: the staging rows are the previous kernels' output
  pdl::launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t step = int64_t{gridDim.x} * (kThreads / 32) * kRows;
  for (int64_t g0 = (int64_t{blockIdx.x} * (kThreads / 32) + (threadIdx.x >> 5)) * kRows; g0 < a.total_rows; g0 += step) {
    uint4 v[kRows][kIters];
    uint32_t scale[kRows];
    int64_t slot[kRows], islot[kRows];
    int jn[kRows];
    // Loads of every row of the batch, then the stores.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t g = g0 + r;
      slot[r] = -1;
      islot[r] = -1;
      jn[r] = 0;
      scale[r] = 0;
      if (g < a.total_rows) {
        while (jn[r] + 1 < a.num_jobs && g >= a.j[jn[r] + 1].row_begin) ++jn[r];
        const CombineJobArgs& j = a.j[jn[r]];
        const int64_t i = g - j.row_begin;
        slot[r] = __ldg(j.slot_mapping + i);
        islot[r] = j.indexer_slot_mapping != nullptr ? __ldg(j.indexer_slot_mapping + i) : slot[r];
        const uint8_t* row = j.rows + i * a.row_bytes;
#pragma unroll
        for (int k = 0; k < kIters; ++k) {
          const int c = lane + 32 * k;
          if (c < a.num_chunks) {
            const int64_t src = c < a.mla_chunks ? 16 * c : a.index_data_offset + 16 * (c - a.mla_chunks);
            v[r][k] = __ldcs(reinterpret_cast<const uint4*>(row + src));
          }
        }
        if (a.has_indexer && lane == 31) scale[r] = __ldcs(reinterpret_cast<const uint32_t*>(row + a.index_scale_offset));
      }
    }
    // The batch's scales in one store when its kRows slots are consecutive, of one job and start at a multiple
    // of kRows (a prefill's rows): they are then adjacent and 4 * kRows-byte aligned in one indexer block's
    // scale region, and one store replaces kRows partial-sector ones (docs/perf.md section 28).
    bool scales_packed = kRows > 1 && a.has_indexer && a.store_align >= 4 * kRows && islot[0] >= 0 &&
                         (islot[0] & (kRows - 1)) == 0 && a.j[jn[0]].index_block_mask >= kRows - 1;
#pragma unroll
    for (int r = 1; r < kRows; ++r) scales_packed = scales_packed && islot[r] == islot[0] + r && jn[r] == jn[0];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (slot[r] < 0 && islot[r] < 0) continue;  // uniform across the warp
      const CombineJobArgs& j = a.j[jn[r]];
      const int64_t sl = slot[r], isl = islot[r];
      uint8_t* mla = j.mla_base + (sl >> j.block_shift) * j.block_stride + (sl & j.block_mask) * j.row_stride;
      uint8_t* iblock = j.index_base + (isl >> j.index_block_shift) * j.index_block_stride;
      const int64_t ioff = isl & j.index_block_mask;
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int c = lane + 32 * k;
        if (c < a.num_chunks && (c < a.mla_chunks ? sl : isl) >= 0) {
          uint8_t* dst = c < a.mla_chunks ? mla + 16 * c : iblock + ioff * kIndexHeadDim + 16 * (c - a.mla_chunks);
          if (a.store_align >= 16) {
            // Evict-first: the rows go to caches larger than L2 and are not read again in this layer;
            // 1.5-2.3% faster than write-back stores (docs/perf.md section 25).
            stg16_cs(dst, v[r][k].x, v[r][k].y, v[r][k].z, v[r][k].w);
          } else {
            const uint32_t w[4] = {v[r][k].x, v[r][k].y, v[r][k].z, v[r][k].w};
            store_bytes<16>(dst, w, a.store_align);
          }
        }
      }
      if (a.has_indexer && lane == 31 && !scales_packed && isl >= 0)
        store_bytes<4>(iblock + j.index_scale_base + ioff * 4, &scale[r], a.store_align);
    }
    if (scales_packed && lane == 31) {
      const CombineJobArgs& j = a.j[jn[0]];
      const int64_t sl = islot[0];
      uint8_t* dst = j.index_base + (sl >> j.index_block_shift) * j.index_block_stride + j.index_scale_base +
                     (sl & j.index_block_mask) * 4;
      store_bytes<4 * kRows>(dst, scale, 4 * kRows);
    }
  }
}

uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

using CombineFn = void (*)(CombineArgs);

/// CTAs of `fn` resident at once on the current device (occupancy API), cached per kernel and device.
int64_t resident_ctas(CombineFn fn) {
  static std::mutex mu;
  static std::map<std::pair<CombineFn, int>, int64_t> cache;
  int device = 0;
  PCPKV_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({fn, device});
  if (it != cache.end()) return it->second;
  int per_sm = 0;
  PCPKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreads, 0));
  const int64_t n = int64_t{std::max(1, per_sm)} * num_sms();
  cache.emplace(std::make_pair(fn, device), n);
  return n;
}

/// The first kernel: up to 8 CTAs per SM (as before). The batched kernels: a persistent grid of the CTAs
/// that are resident at once (80-100 registers: 2-3 CTAs per SM), so no second wave trails the first.
int grid_for(CombineFn fn, int64_t rows, int rows_per_warp) {
  const int64_t per_cta = int64_t{kThreads / 32} * rows_per_warp;
  const int64_t want = (rows + per_cta - 1) / per_cta;
  const int64_t cap = rows_per_warp == 1 ? int64_t{num_sms()} * 8 : resident_ctas(fn);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, cap)));
}

CombineFn pick_combine(int rows_per_warp, int num_chunks) {
  const bool wide = num_chunks > 64;  // bf16 rows: 3 chunks per lane
  switch (rows_per_warp) {
    case 2: return wide ? combine_rows_kernel<2, 3> : combine_rows_kernel<2, 2>;
    case 4: return wide ? combine_rows_kernel<4, 3> : combine_rows_kernel<4, 2>;
    default: return combine_kernel;
  }
}

}  // namespace

void launch_combine(const CombineParams* jobs, int num_jobs, cudaStream_t stream, int rows_per_warp, bool pdl) {
  if (rows_per_warp == 0) rows_per_warp = kDefaultCombineRowsPerWarp;
  PCPKV_CHECK(rows_per_warp == 1 || rows_per_warp == 2 || rows_per_warp == 4,
              "combine: rows_per_warp = {} is not 1, 2 or 4", rows_per_warp);
  for (int i = 0; i < num_jobs; ++i) {
    validate_combine_shape(jobs[i]);
    PCPKV_CHECK(addr(jobs[i].rows) % 16 == 0, "combine: job {}: rows must be 16-byte aligned", i);
    PCPKV_CHECK(jobs[i].fmt.kv_format == jobs[0].fmt.kv_format && jobs[i].fmt.has_indexer == jobs[0].fmt.has_indexer,
                "combine: job {}: every job of one launch must share the cache format", i);
  }
  validate_combine_jobs(jobs, num_jobs);
  for (int first = 0; first < num_jobs; first += kMaxJobs) {
    const int n = std::min(kMaxJobs, num_jobs - first);
    CombineArgs a;
    std::memset(&a, 0, sizeof(a));
    const CombineParams& p0 = jobs[first];
    const TransportRowLayout layout = transport_row_layout(p0.fmt);
    a.num_jobs = n;
    a.mla_chunks = static_cast<int32_t>(layout.mla_bytes / 16);
    a.num_chunks = a.mla_chunks + (p0.fmt.has_indexer ? static_cast<int32_t>(kIndexHeadDim / 16) : 0);
    a.row_bytes = layout.row_bytes;
    a.index_data_offset = layout.index_data_offset;
    a.index_scale_offset = layout.index_scale_offset;
    a.has_indexer = p0.fmt.has_indexer;
    uint64_t bits = 0;
    int64_t begin = 0;
    for (int k = 0; k < n; ++k) {
      const CombineParams& p = jobs[first + k];
      CombineJobArgs& j = a.j[k];
      j.rows = p.rows;
      j.slot_mapping = p.slot_mapping;
      j.indexer_slot_mapping = p.indexer_slot_mapping;
      j.mla_base = p.target.mla_base;
      j.row_stride = p.target.mla.row_stride;
      j.block_stride = p.target.mla.block_stride;
      j.block_shift = __builtin_ctz(static_cast<unsigned>(p.target.mla.block_size));
      j.block_mask = p.target.mla.block_size - 1;
      bits |= addr(p.target.mla_base) | static_cast<uint64_t>(j.row_stride) | static_cast<uint64_t>(j.block_stride);
      if (p.fmt.has_indexer) {
        j.index_base = p.target.index_base;
        j.index_block_stride = p.target.index.block_stride;
        j.index_scale_base = int64_t{p.target.index.block_size} * kIndexHeadDim;
        j.index_block_shift = __builtin_ctz(static_cast<unsigned>(p.target.index.block_size));
        j.index_block_mask = p.target.index.block_size - 1;
        bits |= addr(p.target.index_base) | static_cast<uint64_t>(j.index_block_stride);
      }
      j.row_begin = begin;
      begin += int64_t{p.num_src_ranks} * p.max_local_tokens;
    }
    a.total_rows = begin;
    a.store_align = align_of(bits);
    if (a.total_rows == 0) continue;
    const CombineFn fn = pick_combine(rows_per_warp, a.num_chunks);
    const int grid = grid_for(fn, a.total_rows, rows_per_warp);
    if (pdl) {
      PCPKV_CUDA_CHECK(pdl::launch(fn, dim3(grid), dim3(kThreads), 0, stream, true, a));
    } else {
      fn<<<grid, kThreads, 0, stream>>>(a);
    }
    PCPKV_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace pcpkv::cuda
