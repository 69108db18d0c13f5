// CUDA DSA indexer (SPEC section 6): scores by the rules of pcpkv/device/consumers.h (bit-identical to
// indexer_reference), then an exact block-wide radix select + bitonic sort for the top-k.
// Two score kernels: kExact logits on fp64 tensor cores (DMMA m16n8k16: every partial sum of E4M3
// products is exact in fp64, so the hardware's internal order cannot change a bit), and the first
// CUDA-core kernel for the kFp32Tree order (kept for comparison; 4x load-bound on shared memory).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/consumers.h"
#include "pcpkv/core/error.h"
#include "pcpkv/consumers/indexer.h"

namespace pcpkv::cuda {

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) PCPKV_FAIL("indexer: {}: {}", what, cudaGetErrorString(e));
}

constexpr int kScoreThreads = 128;  // keys per score block
constexpr int kTopkThreads = 1024;

/// Slot of key position j of a request (block table row `table`).
__device__ __forceinline__ int64_t key_slot(const int32_t* table, int64_t j, int32_t bs) {
  return int64_t{table[j / bs]} * bs + j % bs;
}

/// kFp32Tree scores. grid (ceil(max_keys / 128), tokens of this pass); block: 128 keys of one query token.
/// smem: q of the token as fp32 [H, 128] | folded head weights [H].
__global__ void __launch_bounds__(kScoreThreads) index_scores_tree_kernel(IndexerParams p, int64_t tok0, float c,
                                                                          float* ws) {
  extern __shared__ float smem[];
  const int64_t t = tok0 + blockIdx.y;
  const int32_t req = p.request_idx[t];
  if (req < 0) return;
  const int64_t len = p.positions[t] + 1;
  const int64_t j0 = int64_t{blockIdx.x} * kScoreThreads;
  if (j0 >= len) return;  // block-uniform: the causal triangle
  const int H = p.num_heads;
  float* qs = smem;
  float* w = smem + H * consumers::kIndexDim;
  const uint8_t* qb = p.q_fp8 + t * H * consumers::kIndexDim;
  for (int i = threadIdx.x; i < H * consumers::kIndexDim; i += kScoreThreads) qs[i] = codec::e4m3_to_float(qb[i]);
  for (int h = threadIdx.x; h < H; h += kScoreThreads)
    w[h] = consumers::index_head_weight(p.weights[t * H + h], c, p.q_scale[t * H + h]);
  __syncthreads();
  const int64_t j = j0 + threadIdx.x;
  if (j >= len) return;
  const int32_t bs = p.geometry.block_size;
  const int64_t slot = key_slot(p.block_tables + int64_t{req} * p.block_table_stride, j, bs);
  const int64_t block_base = (slot / bs) * p.geometry.block_stride;
  const uint32_t* kw =
      reinterpret_cast<const uint32_t*>(p.index_cache + block_base + (slot % bs) * consumers::kIndexDim);
  float k[consumers::kIndexDim];
#pragma unroll
  for (int i = 0; i < consumers::kIndexDim / 4; ++i) {
    const uint32_t v = kw[i];
#pragma unroll
    for (int e = 0; e < 4; ++e) k[4 * i + e] = codec::e4m3_to_float(static_cast<uint8_t>(v >> (8 * e)));
  }
  const float k_scale = *reinterpret_cast<const float*>(p.index_cache + block_base +
                                                         int64_t{bs} * consumers::kIndexDim + (slot % bs) * 4);
  const float score = consumers::index_score(H, k_scale, [&](int h) {
    return consumers::index_term(consumers::index_logit_tree(qs + h * consumers::kIndexDim, k), w[h]);
  });
  ws[(t - tok0) * p.max_keys + j] = score;
  if (p.scores) p.scores[t * p.max_keys + j] = score;
}

// ---- kExact scores on fp64 tensor cores ---------------------------------------------------------------
//
// CTA = 128 keys of one query token, 4 warps; warp w owns keys [32w, 32w + 32) as four n8 blocks and runs
// every head (16-row m blocks, 32 heads per pass) over the 128 dims in 8 k-steps of mma.m16n8k16.f64.
// Fragment layouts (PTX ISA; CuTe SM90_16x8x16_F64F64F64F64_TN), g = lane / 4, i = lane % 4:
//   A a[v]: row g + 8 (v % 2), k = i + 4 (v / 2);  B b[v]: k = i + 4 v, col g;
//   C c[v]: row g + 8 (v / 2), col 2 i + v % 2.
// The dot product is exact whatever the k order, so the logical k of a step maps to the physical dims as
// d = 16 s + 4 (k % 4) + k / 4: a thread's A (per row) and B elements are then 4 consecutive bytes.
// The per-key head sum stays sequential in h: terms go through shared memory to one thread per key.

constexpr int kDmmaKeys = 128;
constexpr int kDmmaThreads = 128;
constexpr int kDmmaPitch = 144;  // smem row pitch of 128 bytes: 36 words, fragment loads hit 32 banks
constexpr int kDmmaHeadPass = 32;

struct DmmaSmem {
  uint8_t q[128][kDmmaPitch];                   // (heads, dims) E4M3, heads >= H zero
  uint8_t k[kDmmaKeys][kDmmaPitch];             // (keys, dims) E4M3, keys >= len zero
  float term[kDmmaKeys][kDmmaHeadPass + 1];     // (keys, heads of the pass) relu(logit) * w
  float w[128];
  float k_scale[kDmmaKeys];
};

/// Four E4M3 bytes (little-endian in u) -> exact doubles.
__device__ __forceinline__ void e4m3x4_to_f64(uint32_t u, double* out) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(u & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(u >> 16), __NV_E4M3);
  out[0] = static_cast<double>(__half2float(__half(__half_raw{lo.x})));
  out[1] = static_cast<double>(__half2float(__half(__half_raw{lo.y})));
  out[2] = static_cast<double>(__half2float(__half(__half_raw{hi.x})));
  out[3] = static_cast<double>(__half2float(__half(__half_raw{hi.y})));
}

__device__ __forceinline__ void dmma_16816(double* c, const double* a, const double* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, "
      "{%12,%13,%14,%15}, {%0,%1,%2,%3};"
      : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]),
        "d"(b[1]), "d"(b[2]), "d"(b[3]));
#else
  __trap();  // sm_90 only (the build targets sm_90)
#endif
}

/// grid (ceil(max_keys / 128), tokens of this pass), 128 threads.
__global__ void __launch_bounds__(kDmmaThreads) index_scores_dmma_kernel(IndexerParams p, int64_t tok0, float c,
                                                                         float* ws) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DmmaSmem& sm = *reinterpret_cast<DmmaSmem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, i4 = lane & 3;
  const int64_t t = tok0 + blockIdx.y;
  const int32_t req = p.request_idx[t];
  if (req < 0) return;
  const int64_t len = p.positions[t] + 1;
  const int64_t j0 = int64_t{blockIdx.x} * kDmmaKeys;
  if (j0 >= len) return;  // block-uniform: the causal triangle
  const int H = p.num_heads;
  const int Hp = (H + 15) & ~15;
  const int32_t bs = p.geometry.block_size;
  const int32_t* table = p.block_tables + int64_t{req} * p.block_table_stride;

  // q bytes (H rows of 128; rows H..Hp zero), head weights.
  const uint8_t* qb = p.q_fp8 + t * H * consumers::kIndexDim;
  for (int e = tid; e < Hp * 32; e += kDmmaThreads) {
    const int h = e >> 5, wd = e & 31;
    uint32_t v = 0;
    if (h < H) {
      const uint8_t* src = qb + h * consumers::kIndexDim + 4 * wd;
      v = uint32_t{src[0]} | (uint32_t{src[1]} << 8) | (uint32_t{src[2]} << 16) | (uint32_t{src[3]} << 24);
    }
    *reinterpret_cast<uint32_t*>(&sm.q[h][4 * wd]) = v;
  }
  for (int h = tid; h < H; h += kDmmaThreads)
    sm.w[h] = consumers::index_head_weight(p.weights[t * H + h], c, p.q_scale[t * H + h]);
  // key rows: one row per warp instruction (32 lanes x 4 bytes), rows past len zero
  for (int r = warp; r < kDmmaKeys; r += kDmmaThreads / 32) {
    const int64_t j = j0 + r;
    uint32_t v = 0;
    if (j < len) {
      const int64_t slot = key_slot(table, j, bs);
      v = reinterpret_cast<const uint32_t*>(p.index_cache + (slot / bs) * p.geometry.block_stride +
                                            (slot % bs) * consumers::kIndexDim)[lane];
    }
    *reinterpret_cast<uint32_t*>(&sm.k[r][4 * lane]) = v;
  }
  {
    const int64_t j = j0 + tid;
    float s = 0.0f;
    if (j < len) {
      const int64_t slot = key_slot(table, j, bs);
      s = *reinterpret_cast<const float*>(p.index_cache + (slot / bs) * p.geometry.block_stride +
                                          int64_t{bs} * consumers::kIndexDim + (slot % bs) * 4);
    }
    sm.k_scale[tid] = s;
  }
  __syncthreads();

  float acc = 0.0f;  // thread tid owns key tid: sum over heads, ascending
  for (int hg = 0; hg < Hp; hg += kDmmaHeadPass) {
    const int nb = Hp - hg >= 32 ? 2 : 1;  // m16 blocks in this pass
    double cf[2][4][4];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int v = 0; v < 4; ++v) cf[mb][f][v] = 0.0;
#pragma unroll 2
    for (int s = 0; s < 8; ++s) {
      const int d0 = 16 * s + 4 * i4;
      double b[4][4];
#pragma unroll
      for (int f = 0; f < 4; ++f)
        e4m3x4_to_f64(*reinterpret_cast<const uint32_t*>(&sm.k[32 * warp + 8 * f + g][d0]), b[f]);
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
        if (mb >= nb) break;
        const int r0 = hg + 16 * mb + g;
        double lo[4], hi[4], a[8];
        e4m3x4_to_f64(*reinterpret_cast<const uint32_t*>(&sm.q[r0][d0]), lo);
        e4m3x4_to_f64(*reinterpret_cast<const uint32_t*>(&sm.q[r0 + 8][d0]), hi);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          a[2 * v] = lo[v];      // a[2v]: row g, k = i + 4v -> d = 16 s + 4 i + v
          a[2 * v + 1] = hi[v];  // a[2v + 1]: row g + 8, same k
        }
#pragma unroll
        for (int f = 0; f < 4; ++f) dmma_16816(cf[mb][f], a, b[f]);
      }
    }
    // Epilogue of the pass: term = relu(fp32(logit)) * w, in smem by (key, head).
#pragma unroll
    for (int mb = 0; mb < 2; ++mb) {
      if (mb >= nb) break;
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int hl = 16 * mb + g + 8 * (v >> 1);  // head within the pass
          const int key = 32 * warp + 8 * f + 2 * i4 + (v & 1);
          if (hg + hl < H)
            sm.term[key][hl] = consumers::index_term(consumers::index_logit_from_exact(cf[mb][f][v]), sm.w[hg + hl]);
        }
    }
    __syncthreads();
    const int nh = H - hg < kDmmaHeadPass ? H - hg : kDmmaHeadPass;
    for (int hl = 0; hl < nh; ++hl) acc = fp32::add(acc, sm.term[tid][hl]);
    __syncthreads();  // the next pass rewrites term
  }
  const int64_t j = j0 + tid;
  if (j < len) {
    const float score = consumers::canonical_nan(fp32::mul(acc, sm.k_scale[tid]));
    ws[(t - tok0) * p.max_keys + j] = score;
    if (p.scores) p.scores[t * p.max_keys + j] = score;
  }
}

/// One block per query token: radix select of the k-th largest unique sort key (8 digits of 8 bits,
/// early exit once the remaining count fills a bin), gather of every key >= it, bitonic sort descending.
/// smem: room for pow2(topk) uint64 keys; a token sorts only pow2(k) of them.
__global__ void __launch_bounds__(kTopkThreads) index_topk_kernel(IndexerParams p, int64_t tok0, const float* ws) {
  extern __shared__ uint64_t buf[];
  __shared__ int hist[256];
  __shared__ uint64_t s_prefix;
  __shared__ int s_remaining, s_done, s_count;
  const int tid = threadIdx.x;
  const int64_t t = tok0 + blockIdx.x;
  int32_t* out_slots = p.topk_slots + t * p.topk;
  int32_t* out_pos = p.topk_positions ? p.topk_positions + t * p.topk : nullptr;
  const int32_t req = p.request_idx[t];
  if (req < 0) {
    for (int i = tid; i < p.topk; i += kTopkThreads) {
      out_slots[i] = -1;
      if (out_pos) out_pos[i] = -1;
    }
    return;
  }
  const int64_t len = p.positions[t] + 1;
  const int k = static_cast<int>(len < p.topk ? len : p.topk);
  const float* sc = ws + (t - tok0) * p.max_keys;
  int kp = 1;
  while (kp < k) kp <<= 1;

  uint64_t prefix = 0, mask = 0;
  if (len > k) {
    int remaining = k;
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kTopkThreads) hist[i] = 0;
      __syncthreads();
      for (int64_t j = tid; j < len; j += kTopkThreads) {
        const uint64_t key = consumers::sort_key(sc[j], j);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1);
      }
      __syncthreads();
      if (tid == 0) {
        int cum = 0, sel = 0;
        for (int b = 255; b >= 0; --b) {
          if (cum + hist[b] >= remaining) {
            sel = b;
            break;
          }
          cum += hist[b];
        }
        remaining -= cum;
        s_prefix = prefix | (static_cast<uint64_t>(sel) << shift);
        s_remaining = remaining;
        s_done = hist[sel] == remaining;  // the whole bin is in: every key >= prefix is selected
      }
      __syncthreads();
      prefix = s_prefix;
      remaining = s_remaining;
      mask |= 0xffull << shift;
      const bool done = s_done;
      __syncthreads();  // s_* are rewritten next pass only after everyone has read them
      if (done) break;
    }
  }
  // Gather the k keys >= prefix (unique keys: exactly k), in any order; the sort fixes it.
  if (tid == 0) s_count = 0;
  __syncthreads();
  for (int64_t j = tid; j < len; j += kTopkThreads) {
    const uint64_t key = consumers::sort_key(sc[j], j);
    if (key >= prefix) buf[atomicAdd(&s_count, 1)] = key;
  }
  __syncthreads();
  for (int i = k + tid; i < kp; i += kTopkThreads) buf[i] = 0;  // 0 sorts last (positions < 2^31)
  __syncthreads();
  for (int size = 2; size <= kp; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < kp; i += kTopkThreads) {
        const int j = i ^ stride;
        if (j > i) {
          const uint64_t a = buf[i], b = buf[j];
          const bool desc = (i & size) == 0;
          if (desc ? (a < b) : (a > b)) {
            buf[i] = b;
            buf[j] = a;
          }
        }
      }
      __syncthreads();
    }
  const int32_t* table = p.block_tables + int64_t{req} * p.block_table_stride;
  for (int i = tid; i < p.topk; i += kTopkThreads) {
    int32_t slot = -1, pos = -1;
    if (i < k) {
      const int64_t j = consumers::sort_key_position(buf[i]);
      slot = static_cast<int32_t>(key_slot(table, j, p.geometry.block_size));
      pos = static_cast<int32_t>(j);
    }
    out_slots[i] = slot;
    if (out_pos) out_pos[i] = pos;
  }
}

int pow2_at_least(int x) {
  int v = 1;
  while (v < x) v <<= 1;
  return v;
}

}  // namespace

int64_t indexer_min_workspace_bytes(const IndexerParams& p) { return std::max<int64_t>(p.max_keys, 1) * 4; }

namespace {

/// The scalar checks of every entry point (device contents are the caller's: validate_indexer).
void check_scalars(const IndexerParams& p) {
  validate_indexer_scalars(p);
  PCPKV_CHECK(p.geometry.block_stride % 4 == 0, "indexer: geometry.block_stride = {} must be a multiple of 4",
              p.geometry.block_stride);
  if (p.num_tokens == 0) return;
  PCPKV_CHECK(p.q_fp8 && p.q_scale && p.weights && p.positions && p.request_idx && p.block_tables &&
                  p.index_cache && p.topk_slots,
              "indexer: a required device pointer is null");
  PCPKV_CHECK(reinterpret_cast<uintptr_t>(p.index_cache) % 4 == 0, "indexer: index_cache must be 4-byte aligned");
  PCPKV_CHECK(p.max_keys >= 1 && p.max_keys < (int64_t{1} << 31), "indexer: max_keys must be in [1, 2^31), got {}",
              p.max_keys);
}

void check_range(const IndexerParams& p, int64_t tok0, int64_t n) {
  PCPKV_CHECK(tok0 >= 0 && n >= 0 && tok0 + n <= p.num_tokens && n <= 65535,
              "indexer: token range [{}, {} + {}) must lie in [0, num_tokens = {}) with at most 65535 tokens", tok0,
              tok0, n, p.num_tokens);
}

}  // namespace

void indexer_scores(const IndexerParams& p, int64_t tok0, int64_t n, float* ws, void* stream) {
  check_scalars(p);
  check_range(p, tok0, n);
  if (n == 0) return;
  PCPKV_CHECK(ws, "indexer: ws must be non-null");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const float c = index_weight_scale(p.num_heads);
  if (p.logit == IndexerLogit::kExact) {
    const int smem = static_cast<int>(sizeof(DmmaSmem));
    check_cuda(cudaFuncSetAttribute(index_scores_dmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "smem attribute (dmma scores)");
    const dim3 grid(static_cast<unsigned>((p.max_keys + kDmmaKeys - 1) / kDmmaKeys), static_cast<unsigned>(n));
    index_scores_dmma_kernel<<<grid, kDmmaThreads, smem, s>>>(p, tok0, c, ws);
  } else {
    const int smem = p.num_heads * (consumers::kIndexDim + 1) * 4;
    check_cuda(cudaFuncSetAttribute(index_scores_tree_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "smem attribute (tree scores)");
    const dim3 grid(static_cast<unsigned>((p.max_keys + kScoreThreads - 1) / kScoreThreads), static_cast<unsigned>(n));
    index_scores_tree_kernel<<<grid, kScoreThreads, smem, s>>>(p, tok0, c, ws);
  }
  check_cuda(cudaGetLastError(), "scores launch");
}

void indexer_topk(const IndexerParams& p, int64_t tok0, int64_t n, const float* ws, void* stream) {
  check_scalars(p);
  check_range(p, tok0, n);
  if (n == 0) return;
  PCPKV_CHECK(ws, "indexer: ws must be non-null");
  const int topk_smem = pow2_at_least(p.topk) * 8;
  check_cuda(cudaFuncSetAttribute(index_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, topk_smem),
             "smem attribute (top-k)");
  index_topk_kernel<<<static_cast<unsigned>(n), kTopkThreads, topk_smem, static_cast<cudaStream_t>(stream)>>>(p, tok0,
                                                                                                            ws);
  check_cuda(cudaGetLastError(), "top-k launch");
}

void indexer(const IndexerParams& p, void* workspace, int64_t workspace_bytes, void* stream) {
  check_scalars(p);
  if (p.num_tokens == 0) return;
  PCPKV_CHECK(workspace && workspace_bytes >= indexer_min_workspace_bytes(p),
              "indexer: workspace_bytes = {} is below the minimum {}", workspace_bytes, indexer_min_workspace_bytes(p));
  const int64_t per_pass = std::min<int64_t>({workspace_bytes / (p.max_keys * 4), int64_t{65535}, p.num_tokens});
  float* ws = static_cast<float*>(workspace);
  for (int64_t tok0 = 0; tok0 < p.num_tokens; tok0 += per_pass) {
    const int64_t n = std::min(per_pass, p.num_tokens - tok0);
    indexer_scores(p, tok0, n, ws, stream);
    indexer_topk(p, tok0, n, ws, stream);
  }
}

}  // namespace pcpkv::cuda
