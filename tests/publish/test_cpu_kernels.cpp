// pcpkv-test-labels: unit
// CPU reference kernels (pcpkv/publish/cpu.h) against hand checks: tokens whose bytes are computed here step by step
// with codec.h, and an independent re-statement of SPEC section 2 for random tokens.
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include <fmt/format.h>

#include <gtest/gtest.h>

#include "pcpkv/publish/cpu.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/pack.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/rope.h"
#include "support/bytes.h"
#include "support/error_of.h"
#include "support/guard.h"
#include "support/param_names.h"
#include "support/random_bf16.h"

namespace pcpkv {
namespace {

using test::GuardedBuffer;

constexpr int64_t kQRank = 64;  // small q_lora_rank for kernel tests

// One token batch with its buffers and a one-replica cache, built around DispatchParams.
struct Batch {
  int64_t T;
  CacheFormat fmt;
  std::vector<uint16_t> q_c, kv, k_pe, index_k;
  std::vector<int64_t> positions, slots;
  std::vector<float> q_w, kv_w, ln_w, ln_b;
  RopeTable rope;
  MlaCacheGeometry mg;
  IndexerCacheGeometry ig;
  GuardedBuffer mla, idx;

  Batch(int64_t num_tokens, CacheFormat f, uint64_t seed, int32_t block_size = 4, int64_t num_blocks = 8)
      : T(num_tokens),
        fmt(f),
        rope(make_rope_table(RopeConfig{}, 64)),
        mg(dense_mla_geometry(f.kv_format, num_blocks, block_size)),
        ig(dense_indexer_geometry(num_blocks, block_size)),
        mla(mg.bytes()),
        idx(ig.bytes()) {
    q_c = test::random_bf16(T, kQRank, seed + 1);
    kv = test::random_bf16(T, 512, seed + 2);
    k_pe = test::random_bf16(T, 64, seed + 3, 2, 2.0);
    index_k = test::random_bf16(T, 128, seed + 4);
    q_w = test::random_weights(kQRank, seed + 5);
    kv_w = test::random_weights(512, seed + 6, 1.0, 0.3);
    ln_w = test::random_weights(128, seed + 7, 1.0, 0.2);
    ln_b = test::random_weights(128, seed + 8, 0.0, 0.05);
    for (int64_t t = 0; t < T; ++t) {
      positions.push_back((t * 7 + 3) % 64);
      slots.push_back((t * 5 + 2) % (num_blocks * block_size));  // distinct while T <= num_slots / gcd
    }
  }

  CacheTarget target() {
    CacheTarget t;
    t.mla_base = mla.data();
    t.mla = mg;
    t.index_base = idx.data();
    t.index = ig;
    return t;
  }

  DispatchParams params() {
    DispatchParams p;
    p.num_tokens = T;
    p.q_lora_rank = kQRank;
    p.kv = kv.data();
    p.k_pe = k_pe.data();
    p.index_k = fmt.has_indexer ? index_k.data() : nullptr;
    p.positions = positions.data();
    p.q_norm_w = q_w.data();
    p.kv_norm_w = kv_w.data();
    p.index_ln_w = ln_w.data();
    p.index_ln_b = ln_b.data();
    p.rope_cos_sin = rope.cos_sin.data();
    p.rope_num_positions = rope.num_positions;
    p.q_eps = 1e-5f;
    p.kv_eps = 1e-5f;
    p.index_eps = 1e-6f;
    p.fmt = fmt;
    p.slot_mapping = slots.data();
    return p;
  }
  // Combine of transport rows [2][T / 2][row_bytes] into this batch's replica, by its slots.
  CombineParams combine_params(const uint8_t* rows) {
    CombineParams c;
    c.rows = rows;
    c.num_src_ranks = 2;
    c.max_local_tokens = T / 2;
    c.row_bytes = transport_row_layout(fmt).row_bytes;
    c.slot_mapping = slots.data();
    c.fmt = fmt;
    c.target = target();
    return c;
  }
  // Insert of gathered bf16 rows into this batch's replica, kv_c, k_pe and index_k all read from `bf16`.
  InsertParams insert_params(const uint16_t* bf16) {
    InsertParams ip;
    ip.num_tokens = T;
    ip.kv_c = ip.k_pe = ip.index_k = bf16;
    ip.slot_mapping = slots.data();
    ip.fmt = fmt;
    ip.target = target();
    return ip;
  }
};

// ---- independent re-statement of SPEC section 2 in the canonical order (recursive tree) ----------------

float tree_sum(const float* p, int n) { return n == 1 ? p[0] : tree_sum(p, n / 2) + tree_sum(p + n / 2, n / 2); }

float canon(const float* x, int n, bool squares) {
  std::vector<float> leaves;
  for (int j = 0; j < n; j += 8) {
    float s = 0.0f;
    for (int k = j; k < j + 8; ++k) s = squares ? std::fma(x[k], x[k], s) : s + x[k];
    leaves.push_back(s);
  }
  size_t width = 1;
  while (width < leaves.size()) width *= 2;
  leaves.resize(width, 0.0f);
  return tree_sum(leaves.data(), static_cast<int>(width));
}

std::vector<float> to_float(const uint16_t* x, int n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = codec::bf16_to_float(x[i]);
  return v;
}

std::vector<float> ref_rms(const uint16_t* x, int n, const float* w, float eps) {
  std::vector<float> v = to_float(x, n);
  const float r = 1.0f / std::sqrt(canon(v.data(), n, true) / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = (v[static_cast<size_t>(i)] * r) * w[i];
  return v;
}

void ref_rope(float* x, const float* cs, bool interleaved) {
  for (int i = 0; i < 32; ++i) {
    float& a = x[interleaved ? 2 * i : i];
    float& b = x[interleaved ? 2 * i + 1 : i + 32];
    const float c = cs[i], s = cs[32 + i];
    const float p = a * c, q = b * s, u = b * c, v = a * s;  // four roundings, then the sums
    a = p - q;
    b = u + v;
  }
}

std::vector<float> ref_index(const uint16_t* x, const float* w, const float* b, float eps, const float* cs,
                             bool interleaved) {
  std::vector<float> v = to_float(x, 128);
  const float mu = canon(v.data(), 128, false) / 128.0f;
  for (float& e : v) e = e - mu;
  const float r = 1.0f / std::sqrt(canon(v.data(), 128, true) / 128.0f + eps);
  for (int i = 0; i < 128; ++i) v[static_cast<size_t>(i)] = (v[static_cast<size_t>(i)] * r) * w[i] + b[i];
  ref_rope(v.data(), cs, interleaved);
  return v;
}

// Expected MLA row bytes and indexer bytes of one token, from fp32 values, spelled out per SPEC section 3.
std::vector<uint8_t> ref_mla_row(const std::vector<float>& kv_c, const std::vector<float>& k_pe, const CacheFormat& f) {
  std::vector<uint8_t> row(static_cast<size_t>(mla_row_bytes(f.kv_format)));
  auto put_bf16 = [&](size_t off, float x) {
    const uint16_t h = codec::float_to_bf16(x);
    row[off] = static_cast<uint8_t>(h & 0xff);
    row[off + 1] = static_cast<uint8_t>(h >> 8);
  };
  if (f.kv_format == KvFormat::kBf16) {
    for (size_t i = 0; i < 512; ++i) put_bf16(2 * i, kv_c[i]);
    for (size_t i = 0; i < 64; ++i) put_bf16(1024 + 2 * i, k_pe[i]);
  } else if (f.kv_format == KvFormat::kFp8) {
    for (size_t i = 0; i < 512; ++i) row[i] = codec::float_to_e4m3(kv_c[i] / f.k_scale);
    for (size_t i = 0; i < 64; ++i) row[512 + i] = codec::float_to_e4m3(k_pe[i] / f.k_scale);
  } else {
    for (size_t tile = 0; tile < 4; ++tile) {
      float amax = 0.0f;
      for (size_t i = 128 * tile; i < 128 * (tile + 1); ++i) amax = std::max(amax, std::fabs(kv_c[i]));
      float s;
      if (f.ds_mla_scale == DsMlaScale::kPow2)
        s = std::ldexp(1.0f, static_cast<int>(std::ceil(std::log2(std::max(amax / 448.0f, 1e-4f)))));
      else
        s = std::max(amax / 448.0f, 1.17549435e-38f);
      for (size_t i = 128 * tile; i < 128 * (tile + 1); ++i) row[i] = codec::float_to_e4m3(kv_c[i] / s);
      std::memcpy(row.data() + 512 + 4 * tile, &s, 4);  // host is little-endian
    }
    for (size_t i = 0; i < 64; ++i) put_bf16(528 + 2 * i, k_pe[i]);
  }
  return row;
}

std::vector<uint8_t> ref_index_slot(const std::vector<float>& k) {  // 128 data bytes then 4 scale bytes
  float amax = 0.0f;
  for (float v : k) amax = std::max(amax, std::fabs(v));
  const float s = std::ldexp(1.0f, static_cast<int>(std::ceil(std::log2(std::max(amax, 1e-4f) / 448.0f))));
  std::vector<uint8_t> out(132);
  for (size_t i = 0; i < 128; ++i) out[i] = codec::float_to_e4m3(k[i] / s);
  std::memcpy(out.data() + 128, &s, 4);
  return out;
}

CacheFormat make_fmt(KvFormat k, DsMlaScale s = DsMlaScale::kPow2, bool indexer = true, float k_scale = 1.0f) {
  CacheFormat f;
  f.kv_format = k;
  f.ds_mla_scale = s;
  f.has_indexer = indexer;
  f.k_scale = k_scale;
  return f;
}

// ---- hand-computed token ------------------------------------------------------------------------------

TEST(CpuKernels, HandComputedDsMlaToken) {
  // kv = +-1, +-2, +-4, +-8 repeating: sum of squares 128 * 85 = 10880 exact in any order, mean 21.25.
  // Weights 0.5 / 1 / 2 / 4 per tile make the four tile scales differ. Position 0: RoPE is the identity.
  Batch b(1, make_fmt(KvFormat::kFp8DsMla), 11);
  for (int i = 0; i < 512; ++i) {
    const float mag = static_cast<float>(1 << (i % 4));
    b.kv[static_cast<size_t>(i)] = codec::float_to_bf16(i % 2 ? -mag : mag);
    b.kv_w[static_cast<size_t>(i)] = 0.5f * static_cast<float>(1 << (i / 128));
  }
  b.positions[0] = 0;
  b.slots[0] = 6;  // block 1, row 2
  // Indexer: x = 3 (even i) or -1 (odd i): mean 1, d = +-2, biased variance 4.
  for (int i = 0; i < 128; ++i) b.index_k[static_cast<size_t>(i)] = codec::float_to_bf16(i % 2 ? -1.0f : 3.0f);
  DispatchParams p = b.params();
  CacheTarget t = b.target();
  p.targets = &t;
  p.num_targets = 1;
  dispatch_reference(p);

  // Step by step.
  const float r = 1.0f / std::sqrt(10880.0f / 512.0f + 1e-5f);
  const uint8_t* row = b.mla.data() + b.mg.row_offset(6);
  for (int tile = 0; tile < 4; ++tile) {
    const float w = 0.5f * static_cast<float>(1 << tile);
    const float amax = (8.0f * r) * w;                                            // largest |x| is 8
    const float s = std::ldexp(1.0f, static_cast<int>(std::ceil(std::log2(amax / 448.0f))));
    float stored;
    std::memcpy(&stored, row + 512 + 4 * tile, 4);
    EXPECT_EQ(stored, s) << "tile " << tile;
    for (int i = 128 * tile; i < 128 * tile + 8; ++i) {
      const float x = codec::bf16_to_float(b.kv[static_cast<size_t>(i)]);  // +-1, +-2, +-4, +-8
      const float y = (x * r) * w;
      EXPECT_EQ(row[i], codec::float_to_e4m3(y / s)) << "kv_c[" << i << "]";
      // The dequantized value is within half an e4m3 ulp of y.
      EXPECT_NEAR(codec::e4m3_to_float(row[i]) * s, y, std::fabs(y) / 16) << "kv_c[" << i << "]";
    }
  }
  // k_pe at position 0: x*1 - y*0 = x exactly, so the bf16 bytes are the input's.
  for (int i = 0; i < 64; ++i) {
    uint16_t h;
    std::memcpy(&h, row + 528 + 2 * i, 2);
    EXPECT_EQ(h, b.k_pe[static_cast<size_t>(i)]) << "k_pe[" << i << "]";
  }
  // Indexer: y = (d * r) * w + b, r = 1/sqrt(4 + eps); scale 2^ceil(log2(amax / 448)).
  const float ri = 1.0f / std::sqrt(4.0f + 1e-6f);
  std::vector<float> y(128);
  for (int i = 0; i < 128; ++i) y[static_cast<size_t>(i)] = ((i % 2 ? -2.0f : 2.0f) * ri) * b.ln_w[static_cast<size_t>(i)] + b.ln_b[static_cast<size_t>(i)];
  const std::vector<uint8_t> want = ref_index_slot(y);
  EXPECT_TRUE(test::bytes_equal(want.data(), b.idx.data() + b.ig.data_offset(6), 128, "indexer data of slot 6"));
  EXPECT_TRUE(test::bytes_equal(want.data() + 128, b.idx.data() + b.ig.scale_offset(6), 4, "indexer scale of slot 6"));
  // Nothing else of the caches changed.
  EXPECT_TRUE(b.mla.guards_intact("mla cache"));
  EXPECT_TRUE(test::all_guard(b.mla.data(), b.mg.row_offset(6), "mla bytes before slot 6"));
  EXPECT_TRUE(test::all_guard(b.mla.data() + b.mg.row_offset(6) + 656, b.mg.bytes() - b.mg.row_offset(6) - 656,
                              "mla bytes after slot 6"));
}

TEST(CpuKernels, AllZeroTileGetsScale2PowMinus13AndZeroBytes) {
  // kv = 0: RMSNorm gives exact zeros; every tile's amax is 0 -> pow2 scale 2^-13, bytes 0, never NaN.
  Batch b(1, make_fmt(KvFormat::kFp8DsMla), 12);
  std::fill(b.kv.begin(), b.kv.end(), uint16_t{0});
  DispatchParams p = b.params();
  CacheTarget t = b.target();
  p.targets = &t;
  p.num_targets = 1;
  dispatch_reference(p);
  const uint8_t* row = b.mla.data() + b.mg.row_offset(b.slots[0]);
  for (int tile = 0; tile < 4; ++tile) {
    float s;
    std::memcpy(&s, row + 512 + 4 * tile, 4);
    EXPECT_EQ(s, std::ldexp(1.0f, -13));
  }
  for (int i = 0; i < 512; ++i) ASSERT_EQ(row[i], 0) << i;
}

// ---- random tokens against the independent statement ----------------------------------------------------

struct FmtCase {
  KvFormat kv;
  DsMlaScale scale;
  bool indexer;
  float k_scale;
};

class CpuDispatchFormats : public ::testing::TestWithParam<FmtCase> {};

TEST_P(CpuDispatchFormats, MatchesIndependentStatement) {
  const FmtCase c = GetParam();
  Batch b(24, make_fmt(c.kv, c.scale, c.indexer, c.k_scale), 21, 4, 8);
  for (bool neox_index : {true, false}) {
    Batch bb(24, b.fmt, 21, 4, 8);
    DispatchParams p = bb.params();
    p.index_rope = neox_index ? RopeStyle::kNeox : RopeStyle::kInterleaved;
    CacheTarget t = bb.target();
    p.targets = &t;
    p.num_targets = 1;
    std::vector<uint16_t> q_out(static_cast<size_t>(bb.T * kQRank), 0xA5A5);
    p.q_c = bb.q_c.data();
    p.q_c_stride = kQRank;
    p.q_c_out = q_out.data();
    dispatch_reference(p);
    for (int64_t tok = 0; tok < bb.T; ++tok) {
      const float* cs = bb.rope.row(bb.positions[static_cast<size_t>(tok)]);
      const std::vector<float> q = ref_rms(bb.q_c.data() + tok * kQRank, kQRank, bb.q_w.data(), 1e-5f);
      for (int i = 0; i < kQRank; ++i)
        ASSERT_EQ(q_out[static_cast<size_t>(tok * kQRank + i)], codec::float_to_bf16(q[static_cast<size_t>(i)]))
            << "q_c_out token " << tok << " [" << i << "]";
      const std::vector<float> kv_c = ref_rms(bb.kv.data() + tok * 512, 512, bb.kv_w.data(), 1e-5f);
      std::vector<float> k_pe = to_float(bb.k_pe.data() + tok * 64, 64);
      ref_rope(k_pe.data(), cs, true);
      const int64_t slot = bb.slots[static_cast<size_t>(tok)];
      const std::vector<uint8_t> row = ref_mla_row(kv_c, k_pe, bb.fmt);
      ASSERT_TRUE(test::bytes_equal(row.data(), bb.mla.data() + bb.mg.row_offset(slot), static_cast<int64_t>(row.size()),
                                    fmt::format("token {} MLA row", tok)));
      if (bb.fmt.has_indexer) {
        const std::vector<float> k = ref_index(bb.index_k.data() + tok * 128, bb.ln_w.data(), bb.ln_b.data(), 1e-6f,
                                               cs, !neox_index);
        const std::vector<uint8_t> want = ref_index_slot(k);
        ASSERT_TRUE(test::bytes_equal(want.data(), bb.idx.data() + bb.ig.data_offset(slot), 128,
                                      fmt::format("token {} indexer data", tok)));
        ASSERT_TRUE(test::bytes_equal(want.data() + 128, bb.idx.data() + bb.ig.scale_offset(slot), 4,
                                      fmt::format("token {} indexer scale", tok)));
      }
    }
    EXPECT_TRUE(bb.mla.guards_intact("mla"));
    if (bb.fmt.has_indexer) {
      EXPECT_TRUE(bb.idx.guards_intact("indexer"));
    } else {
      EXPECT_TRUE(bb.idx.untouched("indexer cache of a layer without an indexer"));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, CpuDispatchFormats,
                         ::testing::Values(FmtCase{KvFormat::kFp8DsMla, DsMlaScale::kPow2, true, 1.0f},
                                           FmtCase{KvFormat::kFp8DsMla, DsMlaScale::kRaw, true, 1.0f},
                                           FmtCase{KvFormat::kFp8, DsMlaScale::kPow2, true, 0.03125f},
                                           FmtCase{KvFormat::kFp8, DsMlaScale::kPow2, true, 0.0123f},
                                           FmtCase{KvFormat::kBf16, DsMlaScale::kPow2, true, 1.0f},
                                           FmtCase{KvFormat::kFp8DsMla, DsMlaScale::kPow2, false, 1.0f},
                                           FmtCase{KvFormat::kBf16, DsMlaScale::kPow2, false, 1.0f}),
                         [](const ::testing::TestParamInfo<FmtCase>& info) {
                           const FmtCase& c = info.param;
                           return test::format_case_name(c.kv, c.scale, c.indexer, c.k_scale);
                         });

TEST(CpuKernels, HadamardMatchesTokenMath) {
  Batch b(4, make_fmt(KvFormat::kFp8DsMla), 31);
  DispatchParams p = b.params();
  p.index_hadamard = true;
  std::vector<uint16_t> out(4 * 128);
  p.index_k_out = out.data();
  dispatch_reference(p);
  for (int64_t tok = 0; tok < 4; ++tok) {
    std::vector<float> k = ref_index(b.index_k.data() + tok * 128, b.ln_w.data(), b.ln_b.data(), 1e-6f,
                                     b.rope.row(b.positions[static_cast<size_t>(tok)]), false);
    // Independent Walsh-Hadamard: H[i][j] = (-1)^popcount(i & j) / sqrt(128), applied as butterflies.
    for (int h = 1; h < 128; h <<= 1)
      for (int i = 0; i < 128; ++i)
        if (!(i & h)) {
          const float a = k[static_cast<size_t>(i)], c = k[static_cast<size_t>(i + h)];
          k[static_cast<size_t>(i)] = a + c;
          k[static_cast<size_t>(i + h)] = a - c;
        }
    for (int i = 0; i < 128; ++i)
      ASSERT_EQ(out[static_cast<size_t>(tok * 128 + i)], codec::float_to_bf16(k[static_cast<size_t>(i)] * 0.08838834764831845f))
          << "token " << tok << " [" << i << "]";
  }
}

// ---- modes: materialize, transport rows, combine, insert, strides, threads -----------------------------

TEST(CpuKernels, RowsCombineAndDirectAgreeAndPadIsZero) {
  for (KvFormat kvf : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16}) {
    for (bool indexer : {true, false}) {
      const CacheFormat f = make_fmt(kvf, DsMlaScale::kPow2, indexer, 0.05f);
      Batch direct(20, f, 41), staged(20, f, 41);
      staged.slots[3] = -1;  // padding: no cache row, but its transport row is still written
      direct.slots[3] = -1;
      DispatchParams pd = direct.params();
      CacheTarget td = direct.target();
      pd.targets = &td;
      pd.num_targets = 1;
      dispatch_reference(pd);

      const TransportRowLayout layout = transport_row_layout(f);
      std::vector<uint8_t> rows_a(static_cast<size_t>(20 * layout.row_bytes), 0xA5), rows_b = rows_a;
      uint8_t* dests[2] = {rows_a.data(), rows_b.data()};
      DispatchParams ps = staged.params();
      ps.num_row_dests = 2;
      ps.row_dests = dests;
      ps.row_bytes = layout.row_bytes;
      dispatch_reference(ps);
      ASSERT_TRUE(test::bytes_equal(rows_a, rows_b, "the two row destinations"));
      for (int64_t t = 0; t < 20; ++t) {
        const uint8_t* r = rows_a.data() + t * layout.row_bytes;
        if (indexer) {
          for (int64_t k = layout.index_scale_offset + 4; k < layout.row_bytes; ++k) ASSERT_EQ(r[k], 0) << "pad byte " << k;
        }
        if (t == 3) continue;
        ASSERT_TRUE(test::bytes_equal(direct.mla.data() + direct.mg.row_offset(direct.slots[static_cast<size_t>(t)]), r,
                                      layout.mla_bytes, fmt::format("token {}: row MLA part vs cache", t)));
      }
      CombineParams c;
      c.rows = rows_a.data();
      c.num_src_ranks = 2;
      c.max_local_tokens = 10;
      c.row_bytes = layout.row_bytes;
      c.slot_mapping = staged.slots.data();
      c.fmt = f;
      c.target = staged.target();
      combine_reference(c, 3);
      ASSERT_TRUE(test::bytes_equal(direct.mla.data() - 256, staged.mla.data() - 256, direct.mg.bytes() + 512,
                                    fmt::format("{} mla: combine vs direct", to_string(kvf))));
      ASSERT_TRUE(test::bytes_equal(direct.idx.data() - 256, staged.idx.data() - 256, direct.ig.bytes() + 512,
                                    fmt::format("{} indexer: combine vs direct", to_string(kvf))));
    }
  }
}

TEST(CpuKernels, MaterializedBf16AndInsert) {
  for (KvFormat kvf : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16}) {
    const CacheFormat f = make_fmt(kvf, DsMlaScale::kPow2, true, 0.05f);
    Batch fused(16, f, 51), collect(16, f, 51);
    DispatchParams pf = fused.params();
    CacheTarget tf = fused.target();
    pf.targets = &tf;
    pf.num_targets = 1;
    dispatch_reference(pf);

    std::vector<uint16_t> kv_c(16 * 512), k_pe(16 * 64), index_k(16 * 128);
    std::vector<int32_t> topk(16 * 40, 7);
    DispatchParams pm = collect.params();
    pm.kv_c_out = kv_c.data();
    pm.k_pe_out = k_pe.data();
    pm.index_k_out = index_k.data();
    pm.topk_fill = topk.data();
    pm.topk_width = 40;
    dispatch_reference(pm);
    EXPECT_TRUE(collect.mla.untouched("materialize-only dispatch leaves the cache alone"));
    for (int32_t v : topk) ASSERT_EQ(v, -1);
    // Materialized values are bf16 of the fused path's fp32 values.
    for (int64_t tok = 0; tok < 16; ++tok) {
      const std::vector<float> ref = ref_rms(collect.kv.data() + tok * 512, 512, collect.kv_w.data(), 1e-5f);
      for (int i = 0; i < 512; ++i)
        ASSERT_EQ(kv_c[static_cast<size_t>(tok * 512 + i)], codec::float_to_bf16(ref[static_cast<size_t>(i)]));
    }
    InsertParams ip;
    ip.num_tokens = 16;
    ip.kv_c = kv_c.data();
    ip.k_pe = k_pe.data();
    ip.index_k = index_k.data();
    ip.slot_mapping = collect.slots.data();
    ip.fmt = f;
    ip.target = collect.target();
    insert_reference(ip, 2);
    // Each inserted row is the encoding of the widened bf16 values.
    for (int64_t tok = 0; tok < 16; ++tok) {
      const std::vector<uint8_t> row =
          ref_mla_row(to_float(kv_c.data() + tok * 512, 512), to_float(k_pe.data() + tok * 64, 64), f);
      const int64_t slot = collect.slots[static_cast<size_t>(tok)];
      ASSERT_TRUE(test::bytes_equal(row.data(), collect.mla.data() + collect.mg.row_offset(slot),
                                    static_cast<int64_t>(row.size()), fmt::format("inserted token {}", tok)));
    }
    EXPECT_TRUE(collect.mla.guards_intact("mla"));
    // bf16 rows: quantizing from bf16 changes nothing, so collect == fused byte for byte.
    if (kvf == KvFormat::kBf16) {
      EXPECT_TRUE(test::bytes_equal(fused.mla.data(), collect.mla.data(), fused.mg.bytes(), "bf16 collect vs fused"));
    }
  }
}

TEST(CpuKernels, FusedKvApOutputStridesAndThreadCountDoNotChangeBytes) {
  // kv_a_proj_with_mqa output [T, 576]: kv = columns [0, 512), k_pe = [512, 576), both with row stride 576.
  const CacheFormat f = make_fmt(KvFormat::kFp8DsMla);
  Batch dense(40, f, 61, 8, 8), strided(40, f, 61, 8, 8);
  std::vector<uint16_t> kva(40 * 576);
  for (int64_t t = 0; t < 40; ++t) {
    std::copy_n(dense.kv.data() + t * 512, 512, kva.data() + t * 576);
    std::copy_n(dense.k_pe.data() + t * 64, 64, kva.data() + t * 576 + 512);
  }
  std::vector<uint16_t> wide_q(40 * 80);
  for (int64_t t = 0; t < 40; ++t) std::copy_n(dense.q_c.data() + t * kQRank, kQRank, wide_q.data() + t * 80);
  std::vector<uint16_t> q1(40 * kQRank), q2(40 * kQRank);

  DispatchParams a = dense.params();
  CacheTarget ta = dense.target();
  a.targets = &ta;
  a.num_targets = 1;
  a.q_c = dense.q_c.data();
  a.q_c_stride = kQRank;
  a.q_c_out = q1.data();
  dispatch_reference(a, 1);

  DispatchParams b = strided.params();
  CacheTarget tb = strided.target();
  b.targets = &tb;
  b.num_targets = 1;
  b.kv = kva.data();
  b.kv_stride = 576;
  b.k_pe = kva.data() + 512;
  b.k_pe_stride = 576;
  b.q_c = wide_q.data();
  b.q_c_stride = 80;
  b.q_c_out = q2.data();
  dispatch_reference(b, 3);
  EXPECT_TRUE(test::bytes_equal(dense.mla.data() - 256, strided.mla.data() - 256, dense.mg.bytes() + 512, "mla"));
  EXPECT_TRUE(test::bytes_equal(dense.idx.data() - 256, strided.idx.data() - 256, dense.ig.bytes() + 512, "indexer"));
  EXPECT_EQ(q1, q2);
}

TEST(CpuKernels, TwoTargetsGetIdenticalRowsWithPaddedGeometry) {
  const CacheFormat f = make_fmt(KvFormat::kFp8DsMla);
  Batch b(12, f, 71);
  // A second replica with padded rows and blocks.
  MlaCacheGeometry mg2 = b.mg;
  mg2.row_stride = 656 + 48;
  mg2.block_stride = mg2.row_stride * mg2.block_size + 32;
  IndexerCacheGeometry ig2 = b.ig;
  ig2.block_stride = ig2.block_size * 132 + 48;
  GuardedBuffer mla2(mg2.bytes()), idx2(ig2.bytes());
  CacheTarget t[2] = {b.target(), {mla2.data(), mg2, idx2.data(), ig2}};
  DispatchParams p = b.params();
  p.targets = t;
  p.num_targets = 2;
  dispatch_reference(p);
  for (int64_t tok = 0; tok < b.T; ++tok) {
    const int64_t s = b.slots[static_cast<size_t>(tok)];
    ASSERT_TRUE(test::bytes_equal(b.mla.data() + b.mg.row_offset(s), mla2.data() + mg2.row_offset(s), 656, "row"));
    ASSERT_TRUE(test::bytes_equal(b.idx.data() + b.ig.data_offset(s), idx2.data() + ig2.data_offset(s), 128, "idx"));
    ASSERT_TRUE(test::bytes_equal(b.idx.data() + b.ig.scale_offset(s), idx2.data() + ig2.scale_offset(s), 4, "scale"));
  }
  EXPECT_TRUE(mla2.guards_intact("padded mla"));
  EXPECT_TRUE(idx2.guards_intact("padded indexer"));
  // Row and block padding of the second replica stay 0xA5.
  for (int64_t blk = 0; blk < mg2.num_blocks; ++blk) {
    for (int64_t o = 0; o < mg2.block_size; ++o)
      ASSERT_TRUE(test::all_guard(mla2.data() + blk * mg2.block_stride + o * mg2.row_stride + 656, 48, "row pad"));
    ASSERT_TRUE(test::all_guard(mla2.data() + blk * mg2.block_stride + mg2.block_size * mg2.row_stride, 32, "block pad"));
    ASSERT_TRUE(test::all_guard(idx2.data() + blk * ig2.block_stride + ig2.block_size * 132, 48, "indexer block pad"));
  }
}

TEST(CpuKernels, StaticFp8DividesByTheScale) {
  // SPEC section 3: x / s, not x * (1/s); the two differ in the last bit and then, at e4m3 ties, in the byte.
  // Search a (bf16 x, k_scale) pair where they disagree, then insert it and check the division's byte.
  uint16_t x_bits = 0;
  float k_scale = 0.0f;
  for (int xi = 0; xi < 4096 && k_scale == 0.0f; ++xi) {
    const uint16_t xb = static_cast<uint16_t>(0x3f80 + xi);  // bf16 values in [1, ...)
    const float x = codec::bf16_to_float(xb);
    const float tie = 1.0625f;  // midpoint between the e4m3 values 1 and 1.125
    for (int d = -3; d <= 3; ++d) {
      float sd = x / tie;  // then d ulps away
      for (int k = 0; k < std::abs(d); ++k) sd = std::nextafter(sd, d < 0 ? 0.0f : 1e30f);
      if (codec::float_to_e4m3(x / sd) != codec::float_to_e4m3(x * (1.0f / sd))) {
        x_bits = xb;
        k_scale = sd;
        break;
      }
    }
  }
  ASSERT_NE(k_scale, 0.0f) << "no discriminating (x, k_scale) pair found";
  const CacheFormat f = make_fmt(KvFormat::kFp8, DsMlaScale::kPow2, false, k_scale);
  Batch b(1, f, 3);
  std::vector<uint16_t> kv_c(512, x_bits), k_pe(64, x_bits);
  InsertParams ip;
  ip.num_tokens = 1;
  ip.kv_c = kv_c.data();
  ip.k_pe = k_pe.data();
  ip.slot_mapping = b.slots.data();
  ip.fmt = f;
  ip.target = b.target();
  insert_reference(ip);
  const float x = codec::bf16_to_float(x_bits);
  const uint8_t* row = b.mla.data() + b.mg.row_offset(b.slots[0]);
  EXPECT_EQ(row[0], codec::float_to_e4m3(x / k_scale));
  EXPECT_NE(row[0], codec::float_to_e4m3(x * (1.0f / k_scale)));
  EXPECT_EQ(row[512], codec::float_to_e4m3(x / k_scale)) << "k_pe too";
}

// ---- bad parameters: pcpkv::Error naming the field, nothing written -------------------------------------

using test::error_of;

TEST(CpuKernels, BadParametersThrowBeforeWriting) {
  const CacheFormat f = make_fmt(KvFormat::kFp8DsMla);
  struct BadCase {
    const char* expect;
    std::function<void(Batch&, DispatchParams&)> mutate;
  };
  const std::vector<BadCase> cases = {
      {"slot_mapping[5] = 32 is out of range", [](Batch& b, DispatchParams&) { b.slots[5] = 32; }},
      {"slot_mapping[7] = -2 is out of range", [](Batch& b, DispatchParams&) { b.slots[7] = -2; }},
      // The earlier entry is named without repeating the context ("duplicates dispatch: slot_mapping[2]").
      {"duplicates slot_mapping[2]", [](Batch& b, DispatchParams&) { b.slots[9] = b.slots[2]; }},
      {"positions[4] = 64 is out of range [0, 64)", [](Batch& b, DispatchParams&) { b.positions[4] = 64; }},
      {"positions[1] = -1", [](Batch& b, DispatchParams&) { b.positions[1] = -1; }},
      {"fmt.k_scale = 0", [](Batch&, DispatchParams& p) { p.fmt.k_scale = 0.0f; }},
      {"fmt.k_scale = -1", [](Batch&, DispatchParams& p) { p.fmt.k_scale = -1.0f; }},
      {"fmt.k_scale = inf", [](Batch&, DispatchParams& p) { p.fmt.k_scale = INFINITY; }},
      {"kv_stride = 500", [](Batch&, DispatchParams& p) { p.kv_stride = 500; }},
      {"kv is null", [](Batch&, DispatchParams& p) { p.kv = nullptr; }},
      {"index_k is null", [](Batch&, DispatchParams& p) { p.index_k = nullptr; }},
      {"index_k is set but fmt.has_indexer = false", [](Batch&, DispatchParams& p) { p.fmt.has_indexer = false; }},
      {"row_bytes = 720", [](Batch&, DispatchParams& p) {
         static uint8_t row_storage[16 * 800];
         static uint8_t* dest = row_storage;
         p.row_dests = &dest;
         p.num_row_dests = 1;
         p.row_bytes = 720;
       }},
      {"targets[0].mla_base is null", [](Batch&, DispatchParams& p) {
         static CacheTarget t;
         t = CacheTarget{};
         p.targets = &t;
       }},
      {"row_stride = 650", [](Batch& b, DispatchParams& p) {
         static CacheTarget t;
         t = b.target();
         t.mla.row_stride = 650;
         p.targets = &t;
       }},
  };
  for (const BadCase& c : cases) {
    Batch b(16, f, 81);
    DispatchParams p = b.params();
    CacheTarget t = b.target();
    p.targets = &t;
    p.num_targets = 1;
    c.mutate(b, p);
    const std::string msg = error_of([&] { dispatch_reference(p); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in: " << msg;
    EXPECT_TRUE(b.mla.untouched(std::string("mla cache after: ") + c.expect));
    EXPECT_TRUE(b.idx.untouched(std::string("indexer cache after: ") + c.expect));
  }
}

TEST(CpuKernels, BadCombineAndInsertThrowBeforeWriting) {
  const CacheFormat f = make_fmt(KvFormat::kFp8);
  Batch b(8, f, 91);
  std::vector<uint8_t> rows(8 * 720, 1);
  CombineParams c = b.combine_params(rows.data());
  b.slots[6] = b.slots[1];
  EXPECT_NE(error_of([&] { combine_reference(c); }).find("combine: slot_mapping[6]"), std::string::npos);
  b.slots[6] = 1000;
  EXPECT_NE(error_of([&] { combine_reference(c); }).find("slot_mapping[6] = 1000 is out of range"), std::string::npos);
  std::vector<uint16_t> bf(8 * 512, 0x3f80);
  InsertParams ip = b.insert_params(bf.data());
  EXPECT_NE(error_of([&] { insert_reference(ip); }).find("insert: slot_mapping[6] = 1000"), std::string::npos);
  b.slots[6] = 5000;  // in range of nothing, but fix and break k_scale instead
  b.slots[6] = -1;
  ip.fmt.k_scale = NAN;
  EXPECT_NE(error_of([&] { insert_reference(ip); }).find("fmt.k_scale = nan"), std::string::npos);
  // A subnormal scale (x / 1e-45 is inf for every |x| > 2^-21) was accepted: scale_problem's rule.
  ip.fmt.k_scale = 1e-45f;
  EXPECT_NE(error_of([&] { insert_reference(ip); }).find("fmt.k_scale = 1e-45 must be a finite, positive, normal float32"),
            std::string::npos);
  EXPECT_TRUE(b.mla.untouched("mla after bad combine/insert"));
  EXPECT_TRUE(b.idx.untouched("indexer after bad combine/insert"));
}

// The library's combine / insert / dispatch wrote through overlapping outputs (a replica listed twice, an indexer
// cache inside the MLA cache, staging rows inside a cache): only the torch ops refused them. Each case names both
// fields and writes nothing; the CUDA launchers run the same checks (validate_*_shape, validate_*_jobs).
// A bad cache geometry names the target it belongs to, before the geometry's own field and value.
TEST(CpuKernels, BadTargetGeometryNamesTheTarget) {
  const CacheFormat f = make_fmt(KvFormat::kFp8);
  Batch b(8, f, 94);
  CacheTarget t = b.target();
  t.mla.row_stride = 8;
  std::string e = error_of([&] { validate_cache_target(t, f, "dispatch: targets", 3); });
  EXPECT_EQ(e.rfind("dispatch: targets[3]: mla cache: row_stride = 8 B", 0), 0u) << e;
  t = b.target();
  t.index.block_stride = 4;
  e = error_of([&] { validate_cache_target(t, f, "combine: target"); });
  EXPECT_EQ(e.rfind("combine: target: indexer cache: block_stride = 4 B", 0), 0u) << e;
  t.index_base = nullptr;
  e = error_of([&] { validate_cache_target(t, f, "dispatch: targets", 0); });
  EXPECT_EQ(e, "dispatch: targets[0].index_base is null on a layer with an indexer") << e;
  // An indexer cache of another block size (valid geometry of its own): a slot names another row in it.
  t = b.target();
  t.index = dense_indexer_geometry(t.index.num_blocks / 2, t.mla.block_size * 2);
  e = error_of([&] { validate_cache_target(t, f, "combine: target"); });
  EXPECT_EQ(e.rfind(fmt::format("combine: target: indexer cache block_size = {} differs from the MLA cache's {}",
                                t.index.block_size, t.mla.block_size),
                    0),
            0u)
      << e;
  std::vector<uint16_t> bf(8 * 512, 0x3f80);
  InsertParams ip = b.insert_params(bf.data());
  ip.target = t;
  EXPECT_NE(error_of([&] { insert_reference(ip); }).find("insert: target: indexer cache block_size"), std::string::npos);
  EXPECT_TRUE(b.mla.untouched("mla after a mismatched indexer block size"));
  EXPECT_TRUE(b.idx.untouched("indexer after a mismatched indexer block size"));
}

TEST(CpuKernels, OverlappingOutputsAreRefusedNamingBothFieldsBeforeWriting) {
  const CacheFormat f = make_fmt(KvFormat::kFp8);
  Batch b(8, f, 93);
  std::vector<uint8_t> rows(8 * 720, 1);
  CombineParams c = b.combine_params(rows.data());
  const auto refused = [](const std::string& e, const std::string& op, const std::string& a, const std::string& b) {
    return e.rfind(op + ": " + a + " (bytes [0x", 0) == 0 &&
           e.find(") overlaps " + b + " (bytes [0x") != std::string::npos &&
           e.find("an output must not share memory with an input or another output") != std::string::npos;
  };
  std::string e;
  // The indexer cache inside the MLA cache (one byte in), then the staging rows inside the MLA cache.
  c.target.index_base = b.mla.data() + b.mg.bytes() - 1;
  e = error_of([&] { combine_reference(c); });
  EXPECT_TRUE(refused(e, "combine", "target.mla_base", "target.index_base")) << e;
  c.target = b.target();
  c.rows = b.mla.data() + 720;
  e = error_of([&] { combine_reference(c); });
  EXPECT_TRUE(refused(e, "combine", "target.mla_base", "rows")) << e;
  c.rows = rows.data();
  c.slot_mapping = reinterpret_cast<const int64_t*>(b.idx.data());
  e = error_of([&] { combine_reference(c); });
  EXPECT_TRUE(refused(e, "combine", "target.index_base", "slot_mapping")) << e;
  c.slot_mapping = b.slots.data();

  std::vector<uint16_t> bf(8 * 512, 0x3f80);
  InsertParams ip = b.insert_params(bf.data());  // inputs may share memory
  ip.index_k = reinterpret_cast<const uint16_t*>(b.idx.data() + 132);
  e = error_of([&] { insert_reference(ip); });
  EXPECT_TRUE(refused(e, "insert", "target.index_base", "index_k")) << e;
  ip.index_k = bf.data();
  ip.target.mla_base = b.idx.data();
  e = error_of([&] { insert_reference(ip); });
  EXPECT_TRUE(refused(e, "insert", "target.mla_base", "target.index_base")) << e;
  ip.target = b.target();

  // Two jobs of one CUDA launch (validate_*_jobs): one replica twice, a replica over another job's input.
  CombineParams jobs[2] = {c, c};
  e = error_of([&] { validate_combine_jobs(jobs, 2); });
  EXPECT_TRUE(refused(e, "combine", "jobs[0].target.mla_base", "jobs[1].target.mla_base")) << e;
  Batch other(8, f, 94);
  jobs[1].target = other.target();
  jobs[1].rows = b.idx.data();
  e = error_of([&] { validate_combine_jobs(jobs, 2); });
  EXPECT_TRUE(refused(e, "combine", "jobs[0].target.index_base", "jobs[1].rows")) << e;
  InsertParams ins[2] = {ip, ip};
  ins[1].target = other.target();
  ins[1].kv_c = reinterpret_cast<const uint16_t*>(other.mla.data());
  e = error_of([&] { validate_insert_jobs(ins, 2); });
  EXPECT_TRUE(refused(e, "insert", "jobs[1].target.mla_base", "jobs[1].kv_c")) << e;

  // dispatch: a replica listed twice, transport rows inside a replica, a materialized output over an input.
  Batch d(8, f, 95);
  DispatchParams p = d.params();
  CacheTarget targets[2] = {d.target(), d.target()};
  p.targets = targets;
  p.num_targets = 2;
  e = error_of([&] { dispatch_reference(p); });
  EXPECT_TRUE(refused(e, "dispatch", "targets[0].mla_base", "targets[1].mla_base")) << e;
  p.num_targets = 1;
  uint8_t* dest = d.mla.data() + d.mg.bytes() - 720;
  p.row_dests = &dest;
  p.num_row_dests = 1;
  p.row_bytes = 720;
  e = error_of([&] { dispatch_reference(p); });
  EXPECT_TRUE(refused(e, "dispatch", "targets[0].mla_base", "row_dests[0]")) << e;
  p.num_row_dests = 0;
  p.kv_c_out = const_cast<uint16_t*>(p.kv) + 512 * 7;
  e = error_of([&] { dispatch_reference(p); });
  EXPECT_TRUE(refused(e, "dispatch", "kv_c_out", "kv")) << e;
  p.kv_c_out = nullptr;
  std::vector<uint16_t> q_out(8 * kQRank);
  p.q_c = d.q_c.data();
  p.q_c_stride = kQRank;
  p.q_c_out = reinterpret_cast<uint16_t*>(d.idx.data());
  e = error_of([&] { dispatch_reference(p); });
  EXPECT_TRUE(refused(e, "dispatch", "targets[0].index_base", "q_c_out")) << e;
  for (const Batch* x : {&b, &other, &d}) {
    EXPECT_TRUE(x->mla.untouched("mla after refused overlaps"));
    EXPECT_TRUE(x->idx.untouched("indexer after refused overlaps"));
  }

  // Adjacent regions share no byte: an indexer cache right after the MLA cache's last slot, in one allocation.
  test::GuardedBuffer both(b.mg.bytes() + b.ig.bytes());
  c.target.mla_base = both.data();
  c.target.index_base = both.data() + b.mg.bytes();
  EXPECT_NO_THROW(combine_reference(c));
  p.q_c_out = q_out.data();
  EXPECT_NO_THROW(dispatch_reference(p));
}

TEST(CpuKernels, EmptyBatchIsANoOp) {
  Batch b(0, make_fmt(KvFormat::kFp8DsMla), 1);
  DispatchParams p = b.params();
  CacheTarget t = b.target();
  p.targets = &t;
  p.num_targets = 1;
  dispatch_reference(p);
  EXPECT_TRUE(b.mla.untouched("mla"));
}

}  // namespace
}  // namespace pcpkv
