// CUDA sparse MLA attention on bf16 tensor cores (SparseMlaKernel::kMma, SPEC section 6).
//
// CTA = one query token x 64 heads (8 warps); the token's selected slots in tiles of 64 keys. A tile's rows
// are gathered once per CTA and decoded into exact bf16 codes (E4M3 -> bf16 is exact; bf16 rows are copied),
// shared by the 64 heads; the scales stay fp32 outside the MMA:
//   S (64 heads x 64 keys) = Q . K^T: warp (ms = w % 4, ns = w / 4) owns heads 16 ms.., keys 32 ns..; every
//     kv_c tile of 128 dims and the k_pe part is its own fp32 MMA sum, folded in fp32 with that key's scale
//     (fp8_ds_mla: the tile scale; fp8: k_scale; bf16: 1).
//   Online softmax in fp32 (row max / sums of the two key halves meet in shared memory).
//   O (64 x 512) += bf16(P * scale) . codes: warp (mh = w % 2, dq = w / 2) owns heads 32 mh.., dims
//     128 dq.. = kv_c tile dq, so each key has one scale there.
// The arithmetic order depends only on the token's query and index row: bit-reproducible across batches,
// grids and PCP layouts. Error bound: SparseMlaBound with SparseMlaArith::kBf16Mma.
// Fragment layouts are PTX's mma.m16n8k16 (.bf16) ones, g = lane / 4, i = lane % 4:
//   A: {a0,a1} (g, 2i..2i+1), {a2,a3} (g+8, 2i..), {a4,a5} (g, 2i+8..), {a6,a7} (g+8, 2i+8..)
//   B: {b0,b1} (k 2i..2i+1, n g), {b2,b3} (k 2i+8.., n g);  C: c0,c1 (g, 2i..), c2,c3 (g+8, 2i..).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "consumers/kernels/cuda/sparse_mla_mma.h"
#include "pcpkv/device/consumers.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/core/error.h"

namespace pcpkv::cuda::detail {

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) PCPKV_FAIL("sparse_mla (mma): {}: {}", what, cudaGetErrorString(e));
}

constexpr int kThreads = 256;
constexpr int kHeads = 64;   // heads per CTA
constexpr int kKeys = 64;    // selected slots per tile
constexpr int kQk = consumers::kMlaQkDim;
constexpr int kV = consumers::kMlaVDim;
constexpr int kPitch = 584;  // bf16 per smem row: 1168 B = 73 x 16 B, the 8 rows of an ldmatrix hit distinct banks
constexpr int kChunks = kQk / 8;  // 16-byte bf16 chunks per row
constexpr int kPPitch = 72;  // fp32 per P row (8 mod 32 words: float2 fragment reads are conflict-free)

struct Smem {
  uint16_t q[kHeads][kPitch];                    // (heads, 576) bf16 queries; rows >= nh zero
  uint16_t k[kKeys][kPitch];                     // (keys, 576) bf16 codes of the tile; invalid slots zero
  float p[kHeads][kPPitch];                      // (heads, keys) softmax numerators of the tile
  float scale[5][kKeys];                         // (kv_c tile 0..3 | k_pe, keys)
  float red_max[2][kHeads], red_sum[2][kHeads];  // (key half, heads) partial row max / sum
  float m[kHeads], l[kHeads], alpha[kHeads], m_next[kHeads];
  int32_t slot[kKeys];
};

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(ptr))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(ptr))
               : "memory");
}
/// c (16x8 fp32) += a (16x16 bf16) . b (16x8 bf16)
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/// Two floats -> bf16x2 (round to nearest even), x in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float x, float y) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&b);
}
/// Two E4M3 bytes (first in the low byte) -> bf16x2, exactly (E4M3 -> fp16 -> fp32 -> bf16 are exact).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return pack_bf16x2(f.x, f.y);
}

__device__ __forceinline__ uint32_t load_u32(const uint8_t* src) {
  return uint32_t{src[0]} | (uint32_t{src[1]} << 8) | (uint32_t{src[2]} << 16) | (uint32_t{src[3]} << 24);
}

__device__ __forceinline__ const uint8_t* row_ptr(const SparseMlaParams& p, int32_t slot) {
  const int32_t bs = p.geometry.block_size;
  return p.mla_cache + (int64_t{slot} / bs) * p.geometry.block_stride + (int64_t{slot} % bs) * p.geometry.row_stride;
}

/// Elements [8c, 8c + 8) of a cache row as bf16 codes (uint4 = 4 x bf16x2).
template <bool kVec>
__device__ __forceinline__ uint4 decode_chunk(const uint8_t* row, KvFormat fmt, int c) {
  uint4 o;
  if (fmt == KvFormat::kBf16 || (fmt == KvFormat::kFp8DsMla && c >= kV / 8)) {
    const uint8_t* src = fmt == KvFormat::kBf16 ? row + 16 * c : row + kDsMlaKpeOffset + 16 * (c - kV / 8);
    if (kVec) {
      o = *reinterpret_cast<const uint4*>(src);
    } else {
      o.x = load_u32(src);
      o.y = load_u32(src + 4);
      o.z = load_u32(src + 8);
      o.w = load_u32(src + 12);
    }
  } else {  // E4M3 codes at byte 8c (fp8: all 72 chunks; fp8_ds_mla: kv_c)
    uint32_t lo, hi;
    if (kVec) {
      const uint2 raw = *reinterpret_cast<const uint2*>(row + 8 * c);
      lo = raw.x;
      hi = raw.y;
    } else {
      lo = load_u32(row + 8 * c);
      hi = load_u32(row + 8 * c + 4);
    }
    o.x = e4m3x2_to_bf16x2(lo);
    o.y = e4m3x2_to_bf16x2(lo >> 16);
    o.z = e4m3x2_to_bf16x2(hi);
    o.w = e4m3x2_to_bf16x2(hi >> 16);
  }
  return o;
}

/// Scales of a row: kv_c tiles 0..3 and k_pe.
template <bool kVec>
__device__ __forceinline__ void row_scales(const uint8_t* row, const CacheFormat& fmt, bool as_bf16, float* sc) {
  if (fmt.kv_format == KvFormat::kBf16) {
#pragma unroll
    for (int i = 0; i < 5; ++i) sc[i] = 1.0f;
  } else if (fmt.kv_format == KvFormat::kFp8) {
#pragma unroll
    for (int i = 0; i < 5; ++i) sc[i] = fmt.k_scale;
  } else {
    const uint8_t* sp = row + kDsMlaScaleOffset;
    if (kVec) {
      const float4 v = *reinterpret_cast<const float4*>(sp);
      sc[0] = v.x;
      sc[1] = v.y;
      sc[2] = v.z;
      sc[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[i] = fp32::from_bits(load_u32(sp + 4 * i));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) sc[i] = consumers::ds_mla_read_scale(fp32::bits(sc[i]), as_bf16);
    sc[4] = 1.0f;  // k_pe is bf16
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_mma_kernel(SparseMlaParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, i4 = lane & 3;
  const int64_t t = blockIdx.x;
  const int h0 = blockIdx.y * kHeads;
  const int H = p.num_heads;
  const int nh = H - h0 < kHeads ? H - h0 : kHeads;
  const int64_t num_slots = p.geometry.num_blocks * p.geometry.block_size;
  const KvFormat fmt = p.fmt.kv_format;

  for (int e = tid; e < kHeads * kChunks; e += kThreads) {
    const int r = e / kChunks, c = e % kChunks;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < nh) {
      const uint16_t* src = p.q + (t * H + h0 + r) * kQk + 8 * c;
      if (kVec) {
        v = *reinterpret_cast<const uint4*>(src);
      } else {
        v.x = uint32_t{src[0]} | (uint32_t{src[1]} << 16);
        v.y = uint32_t{src[2]} | (uint32_t{src[3]} << 16);
        v.z = uint32_t{src[4]} | (uint32_t{src[5]} << 16);
        v.w = uint32_t{src[6]} | (uint32_t{src[7]} << 16);
      }
    }
    *reinterpret_cast<uint4*>(&sm.q[r][8 * c]) = v;
  }
  if (tid < kHeads) {
    sm.m[tid] = -INFINITY;
    sm.l[tid] = 0.0f;
  }

  const int ms = warp & 3, ns = warp >> 2;  // S role: heads 16 ms.., keys 32 ns..
  const int mh = warp & 1, dq = warp >> 1;  // PV role: heads 32 mh.., dims 128 dq..
  const int row0 = 16 * ms + g, row1 = row0 + 8;
  float acc[2][16][4];  // (m16 block, n8 block of dims, C fragment)
#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int f = 0; f < 16; ++f)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[mb][f][v] = 0.0f;

  const int32_t* idx_row = p.indices + t * p.topk;
  bool seen = false;  // any valid slot (block-uniform): decides "no key" (zeros, -inf) at the end
  for (int tile0 = 0; tile0 < p.topk; tile0 += kKeys) {
    int valid = 0;
    if (tid < kKeys) {
      int32_t s = tile0 + tid < p.topk ? idx_row[tile0 + tid] : -1;
      if (s < -1 || s >= num_slots) s = -1;  // out of range: skipped like -1 (validate on the host)
      sm.slot[tid] = s;
      valid = s >= 0;
    }
    // Also: the previous tile's PV reads of k / p / scale are done, and slot is published.
    if (!__syncthreads_or(valid)) continue;
    seen = true;

    // ---- gather + decode the tile's rows ----
#pragma unroll 6
    for (int e = tid; e < kKeys * kChunks; e += kThreads) {
      const int j = e / kChunks, c = e % kChunks;
      const int32_t s = sm.slot[j];
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (s >= 0) v = decode_chunk<kVec>(row_ptr(p, s), fmt, c);
      *reinterpret_cast<uint4*>(&sm.k[j][8 * c]) = v;
    }
    if (tid < kKeys) {
      float sc[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      if (sm.slot[tid] >= 0) row_scales<kVec>(row_ptr(p, sm.slot[tid]), p.fmt, p.scales_as_bf16, sc);
#pragma unroll
      for (int i = 0; i < 5; ++i) sm.scale[i][tid] = sc[i];
    }
    __syncthreads();

    // ---- S = Q . K^T, one fp32 MMA sum per scale tile, folded with the key's scale ----
    float sv[4][4];  // (n8 block of keys, C fragment)
    {
      float sacc[4][4];
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int v = 0; v < 4; ++v) sacc[f][v] = 0.0f;
      const uint16_t* qa = &sm.q[16 * ms + (lane & 15)][8 * (lane >> 4)];
      const uint16_t* kb0 = &sm.k[32 * ns + (lane & 7) + 8 * (lane >> 4)][8 * ((lane >> 3) & 1)];
      const uint16_t* kb1 = kb0 + 16 * kPitch;
#pragma unroll
      for (int dt = 0; dt < 5; ++dt) {
        float tmp[4][4];
#pragma unroll
        for (int f = 0; f < 4; ++f)
#pragma unroll
          for (int v = 0; v < 4; ++v) tmp[f][v] = 0.0f;
        const int steps = dt < 4 ? 8 : 4;
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          if (ks >= steps) break;
          const int kk = 128 * dt + 16 * ks;
          uint32_t a[4], b0[4], b1[4];
          ldmatrix_x4(a, qa + kk);
          ldmatrix_x4(b0, kb0 + kk);  // keys 32 ns + 0..15: n8 blocks 0 {b0[0], b0[1]}, 1 {b0[2], b0[3]}
          ldmatrix_x4(b1, kb1 + kk);  // keys 32 ns + 16..31: n8 blocks 2, 3
          mma_bf16(tmp[0], a, b0);
          mma_bf16(tmp[1], a, b0 + 2);
          mma_bf16(tmp[2], a, b1);
          mma_bf16(tmp[3], a, b1 + 2);
        }
#pragma unroll
        for (int f = 0; f < 4; ++f)
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const int key = 32 * ns + 8 * f + 2 * i4 + (v & 1);
            sacc[f][v] = fp32::add(sacc[f][v], fp32::mul(tmp[f][v], sm.scale[dt][key]));
          }
      }
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int key = 32 * ns + 8 * f + 2 * i4 + (v & 1);
          sv[f][v] = sm.slot[key] >= 0 ? fp32::mul(sacc[f][v], p.softmax_scale) : -INFINITY;
        }
    }

    // ---- online softmax (rows row0 = v 0,1 and row1 = v 2,3) ----
    float rmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int f = 0; f < 4; ++f)
#pragma unroll
      for (int v = 0; v < 4; ++v) rmax[v >> 1] = fmaxf(rmax[v >> 1], sv[f][v]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rmax[r] = fmaxf(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 1));
      rmax[r] = fmaxf(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 2));
    }
    if (i4 == 0) {
      sm.red_max[ns][row0] = rmax[0];
      sm.red_max[ns][row1] = rmax[1];
    }
    __syncthreads();
    float m_new[2], alpha[2], rsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r ? row1 : row0;
      const float m_old = sm.m[row];
      const float mn = fmaxf(m_old, fmaxf(sm.red_max[0][row], sm.red_max[1][row]));
      m_new[r] = mn;
      alpha[r] = mn == -INFINITY ? 1.0f : (m_old == -INFINITY ? 0.0f : expf(fp32::sub(m_old, mn)));
    }
#pragma unroll
    for (int f = 0; f < 4; ++f)
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float mn = m_new[v >> 1];
        sv[f][v] = (mn == -INFINITY || sv[f][v] == -INFINITY) ? 0.0f : expf(fp32::sub(sv[f][v], mn));
      }
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const int key0 = 32 * ns + 8 * f + 2 * i4;
      *reinterpret_cast<float2*>(&sm.p[row0][key0]) = make_float2(sv[f][0], sv[f][1]);
      *reinterpret_cast<float2*>(&sm.p[row1][key0]) = make_float2(sv[f][2], sv[f][3]);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        rsum[0] = fp32::add(rsum[0], sv[f][c]);
        rsum[1] = fp32::add(rsum[1], sv[f][2 + c]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rsum[r] = fp32::add(rsum[r], __shfl_xor_sync(0xffffffffu, rsum[r], 1));
      rsum[r] = fp32::add(rsum[r], __shfl_xor_sync(0xffffffffu, rsum[r], 2));
    }
    if (i4 == 0) {
      sm.red_sum[ns][row0] = rsum[0];
      sm.red_sum[ns][row1] = rsum[1];
      if (ns == 0) {
        sm.alpha[row0] = alpha[0];
        sm.alpha[row1] = alpha[1];
        sm.m_next[row0] = m_new[0];
        sm.m_next[row1] = m_new[1];
      }
    }
    __syncthreads();
    if (tid < kHeads) {  // running m and l (read again only after the next tile's first barrier)
      sm.l[tid] = fp32::add(fp32::mul(sm.l[tid], sm.alpha[tid]), fp32::add(sm.red_sum[0][tid], sm.red_sum[1][tid]));
      sm.m[tid] = sm.m_next[tid];
    }

    // ---- O = O * alpha + bf16(P * scale) . codes ----
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const float a = sm.alpha[32 * mh + 16 * mb + g + 8 * hi];
#pragma unroll
        for (int f = 0; f < 16; ++f) {
          acc[mb][f][2 * hi] = fp32::mul(acc[mb][f][2 * hi], a);
          acc[mb][f][2 * hi + 1] = fp32::mul(acc[mb][f][2 * hi + 1], a);
        }
      }
    const float* scl = sm.scale[dq];
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks) {
      const int k0 = 16 * ks;
      const float2 s_lo = *reinterpret_cast<const float2*>(&scl[k0 + 2 * i4]);
      const float2 s_hi = *reinterpret_cast<const float2*>(&scl[k0 + 8 + 2 * i4]);
      uint32_t a[2][4];
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
        const int r = 32 * mh + 16 * mb + g;
        const float2 p00 = *reinterpret_cast<const float2*>(&sm.p[r][k0 + 2 * i4]);
        const float2 p10 = *reinterpret_cast<const float2*>(&sm.p[r + 8][k0 + 2 * i4]);
        const float2 p01 = *reinterpret_cast<const float2*>(&sm.p[r][k0 + 8 + 2 * i4]);
        const float2 p11 = *reinterpret_cast<const float2*>(&sm.p[r + 8][k0 + 8 + 2 * i4]);
        a[mb][0] = pack_bf16x2(fp32::mul(p00.x, s_lo.x), fp32::mul(p00.y, s_lo.y));
        a[mb][1] = pack_bf16x2(fp32::mul(p10.x, s_lo.x), fp32::mul(p10.y, s_lo.y));
        a[mb][2] = pack_bf16x2(fp32::mul(p01.x, s_hi.x), fp32::mul(p01.y, s_hi.y));
        a[mb][3] = pack_bf16x2(fp32::mul(p11.x, s_hi.x), fp32::mul(p11.y, s_hi.y));
      }
      const uint16_t* vb = &sm.k[k0 + (lane & 7) + 8 * ((lane >> 3) & 1)][128 * dq + 8 * (lane >> 4)];
#pragma unroll
      for (int fp = 0; fp < 8; ++fp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vb + 16 * fp);  // dims 128 dq + 16 fp..: n8 blocks 2 fp {b[0], b[1]}, 2 fp + 1
#pragma unroll
        for (int mb = 0; mb < 2; ++mb) {
          mma_bf16(acc[mb][2 * fp], a[mb], b);
          mma_bf16(acc[mb][2 * fp + 1], a[mb], b + 2);
        }
      }
    }
  }
  __syncthreads();  // final m and l

#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int row = 32 * mh + 16 * mb + g + 8 * hi;
      if (row >= nh) continue;
      float* out = p.out + (t * H + h0 + row) * kV + 128 * dq + 2 * i4;
      const float l = sm.l[row];
#pragma unroll
      for (int f = 0; f < 16; ++f) {
        out[8 * f] = seen ? fp32::div(acc[mb][f][2 * hi], l) : 0.0f;
        out[8 * f + 1] = seen ? fp32::div(acc[mb][f][2 * hi + 1], l) : 0.0f;
      }
    }
  if (tid < nh) p.lse[t * H + h0 + tid] = seen ? fp32::add(sm.m[tid], logf(sm.l[tid])) : -INFINITY;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

void sparse_mla_mma(const SparseMlaParams& p, cudaStream_t stream) {
  const bool vec = aligned16(p.q) && aligned16(p.mla_cache) && p.geometry.row_stride % 16 == 0 &&
                   p.geometry.block_stride % 16 == 0;
  const int smem = static_cast<int>(sizeof(Smem));
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>((p.num_heads + kHeads - 1) / kHeads));
  if (vec) {
    check_cuda(cudaFuncSetAttribute(sparse_mla_mma_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "smem attribute");
    sparse_mla_mma_kernel<true><<<grid, kThreads, smem, stream>>>(p);
  } else {
    check_cuda(cudaFuncSetAttribute(sparse_mla_mma_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "smem attribute");
    sparse_mla_mma_kernel<false><<<grid, kThreads, smem, stream>>>(p);
  }
  check_cuda(cudaGetLastError(), "launch");
}

}  // namespace pcpkv::cuda::detail
