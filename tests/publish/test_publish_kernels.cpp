// pcpkv-test-labels: cuda
// The CUDA kernels of the publication (pcpkv/publish/kernels.h) against the CPU oracle (pcpkv/publish/cpu.h), byte for
// byte, on whole buffers (guards included): the fused dispatch in every mode (materialize, cache targets with
// different padded geometries and misaligned bases, transport rows, top-k fill) and every kernel variant
// (simple, prefetch, warp), several ranks in one launch, the combine (1, 2, 4 rows per warp), the collect
// path's inserts and all-gather. Seeded random inputs with outlier channels; every
// output poisoned with 0xA5 before the run. Skips with the reason when no GPU is visible.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/cuda/buffers.h"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/publish/cuda.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/core/rope.h"
#include "support/bytes.h"
#include "support/error_of.h"
#include "support/random_bf16.h"
#include "support/gpu.h"

namespace pcpkv {
namespace {

using cuda::DeviceBuffer;

constexpr int64_t kGuard = 64;

/// A host buffer poisoned with 0xA5 and its device twin; `offset` bytes of the payload start are skipped so
/// the payload can start misaligned.
struct Mirror {
  std::vector<uint8_t> host;
  DeviceBuffer dev;
  int64_t offset = 0;
  Mirror() = default;
  Mirror(int64_t payload_bytes, int64_t misalign) : host(static_cast<size_t>(2 * kGuard + misalign + payload_bytes), kGuardByte), dev(static_cast<int64_t>(host.size())), offset(kGuard + misalign) {
    PCPKV_CUDA_CHECK(cudaMemset(dev.data(), kGuardByte, host.size()));
  }
  uint8_t* h() { return host.data() + offset; }
  uint8_t* d() const { return dev.data() + offset; }
  std::vector<uint8_t> download() const { return dev.download<uint8_t>(static_cast<int64_t>(host.size())); }
};

template <class T>
DeviceBuffer upload(const std::vector<T>& v) {
  return v.empty() ? DeviceBuffer(16) : DeviceBuffer::from(v);
}

::testing::AssertionResult same(const Mirror& m, const std::string& what) {
  return test::bytes_equal(m.host, m.download(), what);
}

/// Puts a few non-finite and huge values into a bf16 tensor (both paths must still agree byte for byte).
void add_nonfinite(std::vector<uint16_t>& v, uint64_t seed) {
  const uint16_t specials[] = {0x7f80, 0xff80, 0x7fc0, 0xffc1, 0x7f7f, 0x0001, 0x8000};
  for (int k = 0; k < 7; ++k) v[static_cast<size_t>(test::hash64(seed, k) % v.size())] = specials[k];
}

// ---- the dispatch ----------------------------------------------------------------------------------------

struct DispatchCase {
  std::string name;
  int64_t num_tokens = 37;
  int64_t q_rank = 2048;
  CacheFormat fmt;
  RopeStyle mla_rope = RopeStyle::kInterleaved;
  RopeStyle index_rope = RopeStyle::kNeox;
  bool hadamard = false;
  int64_t in_pad = 0;          // extra elements per input row (row strides > widths)
  int64_t misalign = 0;        // bytes every output payload starts past 16-byte alignment
  int num_targets = 2;         // cache targets, each with its own padded geometry
  bool same_geometry = false;  // every target with target 0's geometry (replicas, as PCP has them): the warp
                               // kernel's one-offset store path
  int num_dests = 2;           // transport-row destinations
  bool materialize = true;     // q_c_out, kv_c_out, k_pe_out, index_k_out
  int64_t topk_width = 2048;   // 0: no fill
  bool nonfinite = false;
  uint64_t seed = 7;
  int64_t index_slots = 0;     // > 0: the indexer cache at its own slots (docs/spec.md 4.2): an indexer_slot_mapping
                               // into an indexer cache of this many slots (rounded up to blocks), padded blocks
};

std::string case_name(const ::testing::TestParamInfo<DispatchCase>& info) { return info.param.name; }

/// One rank's inputs and outputs, on host and device.
struct RankData {
  int64_t T = 0, q_rank = 0;
  int64_t q_stride = 0, kv_stride = 0, kpe_stride = 0, idx_stride = 0;
  std::vector<uint16_t> q_c, kv, k_pe, index_k;
  std::vector<int64_t> positions, slots, index_slots;
  DeviceBuffer d_q_c, d_kv, d_k_pe, d_index_k, d_positions, d_slots, d_index_slots;
  Mirror q_out, kv_out, kpe_out, idx_out, topk;
  std::vector<Mirror> dests;

  RankData(const DispatchCase& c, int64_t T_, int64_t slot_base, int64_t num_slots, uint64_t seed)
      : T(T_), q_rank(c.q_rank) {
    q_stride = c.q_rank + c.in_pad;
    kv_stride = 512 + c.in_pad;
    kpe_stride = 64 + c.in_pad;
    idx_stride = 128 + c.in_pad;
    q_c = test::random_bf16(T, q_stride, seed + 1);
    kv = test::random_bf16(T, kv_stride, seed + 2);
    k_pe = test::random_bf16(T, kpe_stride, seed + 3, 2, 2.0);
    index_k = test::random_bf16(T, idx_stride, seed + 4);
    if (c.nonfinite && T > 0) {
      add_nonfinite(kv, seed + 5);
      add_nonfinite(index_k, seed + 6);
      add_nonfinite(q_c, seed + 7);
      add_nonfinite(k_pe, seed + 8);
    }
    for (int64_t t = 0; t < T; ++t) {
      positions.push_back(static_cast<int64_t>(test::hash64(seed, 100 + t) % 4096));
      // Distinct slots spread over the cache, every 7th token padding (-1).
      slots.push_back(t % 7 == 3 ? -1 : (slot_base + t * 3 + 1) % num_slots);
      // Own indexer slots: reversed, every 5th token's -1 (its MLA row still lands; token 3's indexer row lands
      // without an MLA row).
      if (c.index_slots > 0)
        index_slots.push_back(t % 5 == 1 ? -1 : c.index_slots - 1 - (slot_base + t) % c.index_slots);
    }
    d_index_slots = upload(index_slots);
    d_q_c = upload(q_c);
    d_kv = upload(kv);
    d_k_pe = upload(k_pe);
    d_index_k = upload(index_k);
    d_positions = upload(positions);
    d_slots = upload(slots);
    const int64_t m = c.misalign;
    if (c.materialize) {
      q_out = Mirror(T * c.q_rank * 2, m);
      kv_out = Mirror(T * 512 * 2, m);
      kpe_out = Mirror(T * 64 * 2, m);
      if (c.fmt.has_indexer) idx_out = Mirror(T * 128 * 2, m);
    }
    if (c.topk_width > 0) topk = Mirror(T * c.topk_width * 4, m % 4 == 0 ? m : 0);
    for (int d = 0; d < c.num_dests; ++d) dests.emplace_back(T * transport_row_layout(c.fmt).row_bytes, m);
  }
};

/// Cache targets with different geometries: block sizes 4 / 8 / 16, padded rows, blocks and indexer blocks.
struct Targets {
  std::vector<Mirror> mla, idx;
  std::vector<CacheTarget> host, dev_view;
  DeviceBuffer table;

  Targets(const DispatchCase& c, int64_t num_slots) {
    for (int d = 0; d < c.num_targets; ++d) {
      const int g = c.same_geometry ? 1 : d;  // 1: padded rows and blocks, block size 8
      const int32_t bs = 4 << (g % 3);
      const int64_t blocks = (num_slots + bs - 1) / bs;
      MlaCacheGeometry mg = dense_mla_geometry(c.fmt.kv_format, blocks, bs);
      mg.row_stride += 16 * g;
      mg.block_stride = mg.row_stride * bs + 32 * g;
      const int64_t index_blocks = c.index_slots > 0 ? (c.index_slots + bs - 1) / bs : blocks;
      IndexerCacheGeometry ig = dense_indexer_geometry(index_blocks, bs);
      ig.block_stride += 16 * g + (c.index_slots > 0 ? 48 : 0);
      mla.emplace_back(mg.bytes(), c.misalign);
      idx.emplace_back(ig.bytes(), c.misalign);
      CacheTarget h, v;
      h.mla = v.mla = mg;
      h.index = v.index = ig;
      h.mla_base = mla.back().h();
      h.index_base = idx.back().h();
      v.mla_base = mla.back().d();
      v.index_base = idx.back().d();
      host.push_back(h);
      dev_view.push_back(v);
    }
    table = upload(dev_view);
  }
};

struct Shared {
  std::vector<float> q_w, kv_w, ln_w, ln_b;
  RopeTable rope;
  DeviceBuffer d_q_w, d_kv_w, d_ln_w, d_ln_b, d_rope;
  explicit Shared(const DispatchCase& c)
      : q_w(test::random_weights(c.q_rank, c.seed + 11)),
        kv_w(test::random_weights(512, c.seed + 12, 1.0, 0.3)),
        ln_w(test::random_weights(128, c.seed + 13, 1.0, 0.2)),
        ln_b(test::random_weights(128, c.seed + 14, 0.0, 0.05)) {
    RopeConfig rc;
    rc.scaling = RopeScaling::kDeepseekYarn;
    rc.factor = 40.0;
    rope = make_rope_table(rc, 4096);
    d_q_w = upload(q_w);
    d_kv_w = upload(kv_w);
    d_ln_w = upload(ln_w);
    d_ln_b = upload(ln_b);
    d_rope = upload(rope.cos_sin);
  }
};

/// DispatchParams of one rank; device = true points everything at device memory.
DispatchParams make_params(const DispatchCase& c, RankData& r, Shared& s, Targets* tg, bool device,
                           std::vector<uint8_t*>& dest_ptrs) {
  DispatchParams p;
  p.num_tokens = r.T;
  p.q_lora_rank = c.q_rank;
  if (c.materialize) {  // Q norm goes with q_c_out
    p.q_c = device ? r.d_q_c.as<const uint16_t>() : r.q_c.data();
    p.q_c_stride = r.q_stride;
  }
  p.kv = device ? r.d_kv.as<const uint16_t>() : r.kv.data();
  p.kv_stride = r.kv_stride;
  p.k_pe = device ? r.d_k_pe.as<const uint16_t>() : r.k_pe.data();
  p.k_pe_stride = r.kpe_stride;
  if (c.fmt.has_indexer) {
    p.index_k = device ? r.d_index_k.as<const uint16_t>() : r.index_k.data();
    p.index_k_stride = r.idx_stride;
    p.index_ln_w = device ? s.d_ln_w.as<const float>() : s.ln_w.data();
    p.index_ln_b = device ? s.d_ln_b.as<const float>() : s.ln_b.data();
  }
  p.positions = device ? r.d_positions.as<const int64_t>() : r.positions.data();
  p.q_norm_w = device ? s.d_q_w.as<const float>() : s.q_w.data();
  p.kv_norm_w = device ? s.d_kv_w.as<const float>() : s.kv_w.data();
  p.rope_cos_sin = device ? s.d_rope.as<const float>() : s.rope.cos_sin.data();
  p.rope_num_positions = s.rope.num_positions;
  p.q_eps = 1e-5f;
  p.kv_eps = 1e-6f;
  p.index_eps = 1e-6f;
  p.mla_rope = c.mla_rope;
  p.index_rope = c.index_rope;
  p.index_hadamard = c.hadamard;
  p.fmt = c.fmt;
  if (c.materialize) {
    p.q_c_out = reinterpret_cast<uint16_t*>(device ? r.q_out.d() : r.q_out.h());
    p.kv_c_out = reinterpret_cast<uint16_t*>(device ? r.kv_out.d() : r.kv_out.h());
    p.k_pe_out = reinterpret_cast<uint16_t*>(device ? r.kpe_out.d() : r.kpe_out.h());
    if (c.fmt.has_indexer) p.index_k_out = reinterpret_cast<uint16_t*>(device ? r.idx_out.d() : r.idx_out.h());
  }
  if (c.topk_width > 0) {
    p.topk_fill = reinterpret_cast<int32_t*>(device ? r.topk.d() : r.topk.h());
    p.topk_width = c.topk_width;
  }
  p.slot_mapping = device ? r.d_slots.as<const int64_t>() : r.slots.data();
  if (c.index_slots > 0) p.indexer_slot_mapping = device ? r.d_index_slots.as<const int64_t>() : r.index_slots.data();
  if (tg != nullptr && c.num_targets > 0) {
    p.targets = device ? tg->table.as<const CacheTarget>() : tg->host.data();
    p.num_targets = c.num_targets;
  }
  dest_ptrs.clear();
  for (Mirror& m : r.dests) dest_ptrs.push_back(device ? m.d() : m.h());
  p.num_row_dests = static_cast<int32_t>(dest_ptrs.size());
  p.row_bytes = transport_row_layout(c.fmt).row_bytes;
  return p;
}

void expect_rank_equal(const DispatchCase& c, RankData& r, const std::string& who) {
  if (c.materialize) {
    EXPECT_TRUE(same(r.q_out, who + " q_c_out"));
    EXPECT_TRUE(same(r.kv_out, who + " kv_c_out"));
    EXPECT_TRUE(same(r.kpe_out, who + " k_pe_out"));
    if (c.fmt.has_indexer) {
      EXPECT_TRUE(same(r.idx_out, who + " index_k_out"));
    }
  }
  if (c.topk_width > 0) {
    EXPECT_TRUE(same(r.topk, who + " topk"));
  }
  for (size_t d = 0; d < r.dests.size(); ++d) EXPECT_TRUE(same(r.dests[d], fmt::format("{} row dest {}", who, d)));
}

// warp chooses warp_split or warp_token by T (docs/perf.md 38); each is also run by name, so both paths are
// compared with the oracle at every case's T.
constexpr cuda::DispatchVariant kAllDispatchVariants[] = {
    cuda::DispatchVariant::kSimple,        cuda::DispatchVariant::kPrefetch,
    cuda::DispatchVariant::kWarp,          cuda::DispatchVariant::kWarpPrefetch,
    cuda::DispatchVariant::kWarpToken,     cuda::DispatchVariant::kWarpSplit};

class DispatchKernel : public ::testing::TestWithParam<DispatchCase> {};

TEST_P(DispatchKernel, BytesEqualCpuDispatch) {
  REQUIRE_GPU();
  const DispatchCase& c = GetParam();
  Shared s(c);
  const int64_t num_slots = 3 * c.num_tokens + 16;
  RankData r(c, c.num_tokens, 0, num_slots, c.seed);
  Targets tg(c, num_slots);
  std::vector<uint8_t*> host_dests, dev_dests;
  const DispatchParams hp = make_params(c, r, s, &tg, false, host_dests);
  DispatchParams dp = make_params(c, r, s, &tg, true, dev_dests);
  DeviceBuffer dest_table = upload(dev_dests);
  dp.row_dests = dest_table.as<uint8_t* const>();
  DispatchParams hp2 = hp;
  hp2.row_dests = host_dests.data();
  dispatch_reference(hp2);

  for (auto variant : kAllDispatchVariants) {
    SCOPED_TRACE(cuda::to_string(variant));
    cuda::DispatchJob job{dp, tg.host, dev_dests};
    // Re-poison the device outputs so each variant proves it wrote everything itself.
    for (Mirror* m : {&r.q_out, &r.kv_out, &r.kpe_out, &r.idx_out, &r.topk})
      if (m->dev.bytes() > 0) PCPKV_CUDA_CHECK(cudaMemset(m->dev.data(), kGuardByte, m->dev.bytes()));
    for (Mirror& m : r.dests) PCPKV_CUDA_CHECK(cudaMemset(m.dev.data(), kGuardByte, m.dev.bytes()));
    for (Mirror& m : tg.mla) PCPKV_CUDA_CHECK(cudaMemset(m.dev.data(), kGuardByte, m.dev.bytes()));
    for (Mirror& m : tg.idx) PCPKV_CUDA_CHECK(cudaMemset(m.dev.data(), kGuardByte, m.dev.bytes()));
    cuda::launch_dispatch(&job, 1, nullptr, variant);
    PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
    expect_rank_equal(c, r, "rank 0");
    for (int d = 0; d < c.num_targets; ++d) {
      EXPECT_TRUE(same(tg.mla[static_cast<size_t>(d)], fmt::format("target {} mla", d)));
      EXPECT_TRUE(same(tg.idx[static_cast<size_t>(d)], fmt::format("target {} indexer", d)));
    }
  }
}

CacheFormat make_fmt(KvFormat f, DsMlaScale s, bool indexer, float k_scale = 1.0f) {
  CacheFormat fmt;
  fmt.kv_format = f;
  fmt.ds_mla_scale = s;
  fmt.has_indexer = indexer;
  fmt.k_scale = k_scale;
  return fmt;
}

std::vector<DispatchCase> dispatch_cases() {
  std::vector<DispatchCase> v;
  auto add = [&](DispatchCase c) { v.push_back(std::move(c)); };
  const struct {
    const char* name;
    KvFormat f;
    DsMlaScale s;
    float k_scale;
  } formats[] = {{"ds_mla_pow2", KvFormat::kFp8DsMla, DsMlaScale::kPow2, 1.0f},
                 {"ds_mla_raw", KvFormat::kFp8DsMla, DsMlaScale::kRaw, 1.0f},
                 {"fp8", KvFormat::kFp8, DsMlaScale::kPow2, 0.0173f},
                 {"fp8_pow2_scale", KvFormat::kFp8, DsMlaScale::kPow2, 0.25f},
                 {"bf16", KvFormat::kBf16, DsMlaScale::kPow2, 1.0f}};
  for (const auto& f : formats)
    for (bool indexer : {true, false}) {
      DispatchCase c;
      c.name = fmt::format("{}_{}", f.name, indexer ? "indexer" : "shared");
      c.fmt = make_fmt(f.f, f.s, indexer, f.k_scale);
      add(c);
    }
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16}) {  // replicas of one geometry
    DispatchCase c;
    c.name = fmt::format("same_geometry_5_targets_{}", to_string(f));
    c.num_targets = 5;
    c.same_geometry = true;
    c.fmt = make_fmt(f, DsMlaScale::kPow2, true, f == KvFormat::kFp8 ? 0.0173f : 1.0f);
    add(c);
  }
  {  // DeepSeek-V3.2 dims: q_lora 1536 (192 leaves, padded tree), NeoX indexer rope.
    DispatchCase c;
    c.name = "deepseek_q1536";
    c.q_rank = 1536;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  {  // GLM-5 rope styles: interleaved indexer rope; Hadamard on; NeoX MLA rope.
    DispatchCase c;
    c.name = "interleaved_indexer_hadamard_neox_mla";
    c.index_rope = RopeStyle::kInterleaved;
    c.mla_rope = RopeStyle::kNeox;
    c.hadamard = true;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  {
    DispatchCase c;
    c.name = "neox_indexer_hadamard";
    c.hadamard = true;
    c.fmt = make_fmt(KvFormat::kFp8, DsMlaScale::kPow2, true, 0.05f);
    add(c);
  }
  for (int64_t q : {8, 1000, 3000, 4096}) {  // tiny, 125 leaves, 375 leaves (4 per thread), the maximum
    DispatchCase c;
    c.name = fmt::format("q_lora_{}", q);
    c.q_rank = q;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  for (int64_t m : {2, 4, 8}) {  // misaligned outputs and caches: narrower stores
    DispatchCase c;
    c.name = fmt::format("misaligned_{}", m);
    c.misalign = m;
    c.fmt = make_fmt(m == 2 ? KvFormat::kBf16 : KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  {  // padded input strides, 4-byte aligned rows (stride 2 elements past 16 bytes)
    DispatchCase c;
    c.name = "strided_inputs";
    c.in_pad = 2;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kRaw, true);
    add(c);
  }
  {  // many tokens: the persistent grid loops, the prefetch path crosses iterations
    DispatchCase c;
    c.name = "many_tokens";
    c.num_tokens = 5000;
    c.num_targets = 1;
    c.num_dests = 1;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  {  // the per-GPU size (issue 34): 4096 GLM-5 rows into 8 replicas of one geometry, where warp runs the split
    DispatchCase c;
    c.name = "per_gpu_4096_rows_8_replicas";
    c.num_tokens = 4096;
    c.num_targets = 8;
    c.same_geometry = true;
    c.num_dests = 0;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  for (int64_t t : {1, 3}) {  // a token's two items on neighbouring warps of one CTA; most warps idle
    DispatchCase c;
    c.name = fmt::format("tokens_{}", t);
    c.num_tokens = t;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  {  // past the split rule's bound of 2 tokens per warp of 3168 (H200 / H100): warp runs one warp per token
    DispatchCase c;
    c.name = "above_split_bound_13001";
    c.num_tokens = 13001;
    c.num_targets = 1;
    c.num_dests = 1;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  {  // odd top-k width (scalar fill), no materialization, direct only
    DispatchCase c;
    c.name = "odd_topk_direct_only";
    c.topk_width = 13;
    c.materialize = false;
    c.num_dests = 0;
    c.num_targets = 3;
    c.fmt = make_fmt(KvFormat::kFp8, DsMlaScale::kPow2, true, 0.5f);
    add(c);
  }
  {  // collect-style: materialize only
    DispatchCase c;
    c.name = "materialize_only";
    c.num_targets = 0;
    c.num_dests = 0;
    c.topk_width = 0;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16}) {  // NaN, inf, huge, subnormal inputs
    DispatchCase c;
    c.name = fmt::format("nonfinite_{}", to_string(f));
    c.nonfinite = true;
    c.fmt = make_fmt(f, DsMlaScale::kPow2, true, 0.3f);
    add(c);
  }
  // The indexer cache at its own slots (a smaller cache, padded blocks): every format, misaligned, few tokens
  // (warp's split items), many tokens into replicas of one geometry.
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16}) {
    DispatchCase c;
    c.name = fmt::format("own_index_slots_{}", to_string(f));
    c.index_slots = c.num_tokens + 5;
    c.fmt = make_fmt(f, DsMlaScale::kPow2, true, f == KvFormat::kFp8 ? 0.0173f : 1.0f);
    add(c);
  }
  const struct {
    const char* name;
    int64_t tokens, misalign, index_slots;
    int targets;
  } own[] = {{"own_index_slots_misaligned_4", 37, 4, 39, 2},
             {"own_index_slots_tokens_3", 3, 0, 9, 2},
             {"own_index_slots_4096_rows_4_replicas", 4096, 0, 4100, 4}};
  for (const auto& o : own) {
    DispatchCase c;
    c.name = o.name;
    c.num_tokens = o.tokens;
    c.misalign = o.misalign;
    c.index_slots = o.index_slots;
    c.num_targets = o.targets;
    c.same_geometry = o.targets == 4;  // replicas of one geometry, no transport rows: the per-GPU shape
    if (c.same_geometry) c.num_dests = 0;
    c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
    add(c);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, DispatchKernel, ::testing::ValuesIn(dispatch_cases()), case_name);

// Several ranks in one launch (uneven sizes, one with no tokens), all writing into the same two replicas
// ("direct") and their own transport rows.
TEST(DispatchKernelRanks, SeveralRanksInOneLaunch) {
  REQUIRE_GPU();
  DispatchCase c;
  c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
  c.num_targets = 2;
  c.num_dests = 3;
  Shared s(c);
  const std::vector<int64_t> sizes = {13, 0, 29, 1, 64};
  const int64_t num_slots = 1024;
  Targets tg(c, num_slots);
  std::vector<std::unique_ptr<RankData>> ranks;
  std::vector<std::vector<uint8_t*>> host_dests(sizes.size()), dev_dests(sizes.size());
  std::vector<DeviceBuffer> dest_tables;
  std::vector<cuda::DispatchJob> jobs;
  int64_t slot_base = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ranks.push_back(std::make_unique<RankData>(c, sizes[i], slot_base, num_slots, c.seed + 100 * i));
    slot_base += 3 * sizes[i] + 1;  // slots of different ranks never collide (3t + 1 spacing, disjoint ranges)
    DispatchParams hp = make_params(c, *ranks.back(), s, &tg, false, host_dests[i]);
    hp.row_dests = host_dests[i].data();
    dispatch_reference(hp);
    DispatchParams dp = make_params(c, *ranks.back(), s, &tg, true, dev_dests[i]);
    dest_tables.push_back(upload(dev_dests[i]));
    dp.row_dests = dest_tables.back().as<uint8_t* const>();
    jobs.push_back({dp, tg.host, dev_dests[i]});
  }
  for (auto variant : kAllDispatchVariants) {
    SCOPED_TRACE(cuda::to_string(variant));
    for (auto& r : ranks) {  // every variant must write every byte itself
      for (Mirror* m : {&r->q_out, &r->kv_out, &r->kpe_out, &r->idx_out, &r->topk})
        if (m->dev.bytes() > 0) PCPKV_CUDA_CHECK(cudaMemset(m->dev.data(), kGuardByte, m->dev.bytes()));
      for (Mirror& m : r->dests) PCPKV_CUDA_CHECK(cudaMemset(m.dev.data(), kGuardByte, m.dev.bytes()));
    }
    for (Mirror& m : tg.mla) PCPKV_CUDA_CHECK(cudaMemset(m.dev.data(), kGuardByte, m.dev.bytes()));
    for (Mirror& m : tg.idx) PCPKV_CUDA_CHECK(cudaMemset(m.dev.data(), kGuardByte, m.dev.bytes()));
    cuda::launch_dispatch(jobs.data(), static_cast<int>(jobs.size()), nullptr, variant);
    PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
    for (size_t i = 0; i < sizes.size(); ++i) expect_rank_equal(c, *ranks[i], fmt::format("rank {}", i));
    for (int d = 0; d < c.num_targets; ++d) {
      EXPECT_TRUE(same(tg.mla[static_cast<size_t>(d)], fmt::format("target {} mla", d)));
      EXPECT_TRUE(same(tg.idx[static_cast<size_t>(d)], fmt::format("target {} indexer", d)));
    }
  }
}

TEST(DispatchKernelRanks, BadParameterThrowsBeforeLaunch) {
  REQUIRE_GPU();
  DispatchCase c;
  c.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kPow2, true);
  Shared s(c);
  RankData r(c, 4, 0, 64, 1);
  Targets tg(c, 64);
  std::vector<uint8_t*> dests;
  DispatchParams dp = make_params(c, r, s, &tg, true, dests);
  cuda::DispatchJob job{dp, tg.host, dests};
  job.params.row_bytes = 720;  // wrong for fp8_ds_mla + indexer (800)
  EXPECT_THROW(cuda::launch_dispatch(&job, 1, nullptr), Error);
  job.params.row_bytes = 800;
  job.host_targets.pop_back();  // host copy disagrees with num_targets
  EXPECT_THROW(cuda::launch_dispatch(&job, 1, nullptr), Error);
}

// ---- combine, insert, all-gather ---------------------------------------------------------------------------

struct CopyCase {
  std::string name;
  CacheFormat fmt;
  int64_t misalign = 0;
  bool own_index_slots = false;  // gathered indexer slot mappings into a smaller padded indexer cache (spec 4.2)
};
std::string copy_name(const ::testing::TestParamInfo<CopyCase>& info) { return info.param.name; }

class CombineInsertKernels : public ::testing::TestWithParam<CopyCase> {};

TEST_P(CombineInsertKernels, BytesEqualCpu) {
  REQUIRE_GPU();
  const CopyCase& cc = GetParam();
  const int32_t W = 3;
  const int64_t M = 41;
  const int64_t N = W * M;
  const int64_t num_slots = 4 * N;
  // Gathered slot mapping: distinct slots, padding rows -1.
  std::vector<int64_t> slots(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) slots[static_cast<size_t>(i)] = i % 5 == 2 ? -1 : (i * 7 + 3) % num_slots;
  DeviceBuffer d_slots = upload(slots);
  DispatchCase tc;
  tc.fmt = cc.fmt;
  tc.num_targets = 2;
  tc.misalign = cc.misalign;
  if (cc.own_index_slots) tc.index_slots = N + 3;
  // Own indexer slots (cc.own_index_slots): reversed, -1 on other rows than the MLA mapping's.
  std::vector<int64_t> islots;
  if (cc.own_index_slots)
    for (int64_t i = 0; i < N; ++i) islots.push_back(i % 7 == 4 ? -1 : N + 2 - i);
  DeviceBuffer d_islots = upload(islots);
  Targets insert_tg(tc, num_slots);

  // Combine: random transport rows (every byte random: a pure copy must move them unchanged).
  const TransportRowLayout layout = transport_row_layout(cc.fmt);
  std::vector<uint8_t> rows(static_cast<size_t>(N * layout.row_bytes));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<uint8_t>(test::hash64(5, i));
  DeviceBuffer d_rows = upload(rows);
  // Slot mappings: strided (above); a prefill's consecutive slots from 0 (the batched kernels store a batch's
  // indexer scales at once); consecutive from 2 with each rank's last row padding (batches that start off a
  // multiple of their size or hold a -1 keep the per-row stores).
  std::vector<int64_t> prefill(static_cast<size_t>(N)), shifted(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    prefill[static_cast<size_t>(i)] = i;
    shifted[static_cast<size_t>(i)] = i % M == M - 1 ? -1 : i + 2;
  }
  // Own indexer slots per pattern: reversed; consecutive from 0 (the batched scale stores) with the MLA's
  // strided slots; consecutive from 1 with each rank's first row -1.
  std::vector<int64_t> iprefill, ishifted;
  for (int64_t i = 0; cc.own_index_slots && i < N; ++i) {
    iprefill.push_back(i);
    ishifted.push_back(i % M == 0 ? -1 : i + 1);
  }
  const std::pair<const char*, const std::vector<int64_t>*> patterns[] = {
      {"strided", &slots}, {"prefill", &prefill}, {"shifted", &shifted}};
  const std::vector<int64_t>* index_patterns[] = {&islots, &iprefill, &ishifted};
  const std::vector<int64_t>* mla_for_index[] = {&slots, &slots, &shifted};
  for (int k = 0; k < 3; ++k) {
    const char* pattern = patterns[k].first;
    const std::vector<int64_t>* combine_slots = cc.own_index_slots ? mla_for_index[k] : patterns[k].second;
    const std::vector<int64_t>& combine_islots = *index_patterns[k];
    SCOPED_TRACE(fmt::format("combine slots {}", pattern));
    Targets combine_tg(tc, num_slots);
    DeviceBuffer d_combine_slots = upload(*combine_slots), d_combine_islots = upload(combine_islots);
    std::vector<CombineParams> dev_jobs;
    for (int d = 0; d < tc.num_targets; ++d) {
      CombineParams p;
      p.rows = rows.data();
      p.num_src_ranks = W;
      p.max_local_tokens = M;
      p.row_bytes = layout.row_bytes;
      p.slot_mapping = combine_slots->data();
      p.indexer_slot_mapping = cc.own_index_slots ? combine_islots.data() : nullptr;
      p.fmt = cc.fmt;
      p.target = combine_tg.host[static_cast<size_t>(d)];
      combine_reference(p);
      p.rows = d_rows.data();
      p.slot_mapping = d_combine_slots.as<const int64_t>();
      p.indexer_slot_mapping = cc.own_index_slots ? d_combine_islots.as<const int64_t>() : nullptr;
      p.target = combine_tg.dev_view[static_cast<size_t>(d)];
      dev_jobs.push_back(p);
    }
    // Every combine kernel (rows per warp 1, 2, 4; 123 rows per job: batches cross job boundaries and the
    // last batch is partial), each on re-poisoned targets.
    for (int rows_per_warp : {1, 2, 4}) {
      SCOPED_TRACE(fmt::format("combine rows_per_warp {}", rows_per_warp));
      for (Mirror& m : combine_tg.mla) PCPKV_CUDA_CHECK(cudaMemset(m.dev.data(), kGuardByte, m.dev.bytes()));
      for (Mirror& m : combine_tg.idx) PCPKV_CUDA_CHECK(cudaMemset(m.dev.data(), kGuardByte, m.dev.bytes()));
      cuda::launch_combine(dev_jobs.data(), static_cast<int>(dev_jobs.size()), nullptr, rows_per_warp);
      PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
      for (int d = 0; d < tc.num_targets; ++d) {
        EXPECT_TRUE(same(combine_tg.mla[static_cast<size_t>(d)], fmt::format("combine target {} mla", d)));
        EXPECT_TRUE(same(combine_tg.idx[static_cast<size_t>(d)], fmt::format("combine target {} indexer", d)));
      }
    }
    EXPECT_THROW(cuda::launch_combine(dev_jobs.data(), 1, nullptr, 3), Error);
  }

  // Insert: random bf16 rows with outliers (and a few non-finite values).
  std::vector<uint16_t> kv = test::random_bf16(N, 512, 21), kpe = test::random_bf16(N, 64, 22, 2, 3.0),
                        idx = test::random_bf16(N, 128, 23);
  add_nonfinite(kv, 24);
  add_nonfinite(idx, 25);
  DeviceBuffer d_kv = upload(kv), d_kpe = upload(kpe), d_idx = upload(idx);
  std::vector<InsertParams> ins_jobs;
  for (int d = 0; d < tc.num_targets; ++d) {
    InsertParams p;
    p.num_tokens = N;
    p.kv_c = kv.data();
    p.k_pe = kpe.data();
    p.index_k = cc.fmt.has_indexer ? idx.data() : nullptr;
    p.slot_mapping = slots.data();
    p.indexer_slot_mapping = cc.own_index_slots ? islots.data() : nullptr;
    p.fmt = cc.fmt;
    p.target = insert_tg.host[static_cast<size_t>(d)];
    insert_reference(p);
    p.kv_c = d_kv.as<const uint16_t>();
    p.k_pe = d_kpe.as<const uint16_t>();
    p.index_k = cc.fmt.has_indexer ? d_idx.as<const uint16_t>() : nullptr;
    p.slot_mapping = d_slots.as<const int64_t>();
    p.indexer_slot_mapping = cc.own_index_slots ? d_islots.as<const int64_t>() : nullptr;
    p.target = insert_tg.dev_view[static_cast<size_t>(d)];
    ins_jobs.push_back(p);
  }
  cuda::launch_insert_mla(ins_jobs.data(), static_cast<int>(ins_jobs.size()), nullptr);
  cuda::launch_insert_indexer(ins_jobs.data(), static_cast<int>(ins_jobs.size()), nullptr);
  PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
  for (int d = 0; d < tc.num_targets; ++d) {
    EXPECT_TRUE(same(insert_tg.mla[static_cast<size_t>(d)], fmt::format("insert target {} mla", d)));
    EXPECT_TRUE(same(insert_tg.idx[static_cast<size_t>(d)], fmt::format("insert target {} indexer", d)));
  }
  // Two jobs of one launch writing one replica (they run at once) are refused before anything is enqueued,
  // naming both (validate_combine_jobs / validate_insert_jobs; the launchers accepted them).
  const std::vector<InsertParams> same_ins = {ins_jobs[0], ins_jobs[0]};
  EXPECT_NE(test::error_of([&] { cuda::launch_insert_mla(same_ins.data(), 2, nullptr); })
                .find("insert: jobs[0].target.mla_base (bytes [0x"),
            std::string::npos);
  CombineParams comb;
  comb.rows = d_rows.data();
  comb.num_src_ranks = W;
  comb.max_local_tokens = M;
  comb.row_bytes = layout.row_bytes;
  comb.slot_mapping = d_slots.as<const int64_t>();
  comb.fmt = cc.fmt;
  comb.target = insert_tg.dev_view[0];
  const std::vector<CombineParams> same_comb = {comb, comb};
  const std::string e = test::error_of([&] { cuda::launch_combine(same_comb.data(), 2, nullptr); });
  EXPECT_NE(e.find("combine: jobs[0].target.mla_base (bytes [0x"), std::string::npos) << e;
  EXPECT_NE(e.find(") overlaps jobs[1].target.mla_base (bytes [0x"), std::string::npos) << e;
}

std::vector<CopyCase> copy_cases() {
  std::vector<CopyCase> v;
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16})
    for (bool indexer : {true, false})
      for (int64_t m : {0, 4}) {
        CopyCase c;
        c.fmt = make_fmt(f, DsMlaScale::kPow2, indexer, f == KvFormat::kFp8 ? 0.0371f : 1.0f);
        c.misalign = m;
        c.name = fmt::format("{}_{}_{}", to_string(f), indexer ? "indexer" : "shared", m ? "misaligned" : "aligned");
        v.push_back(c);
      }
  CopyCase raw;
  raw.fmt = make_fmt(KvFormat::kFp8DsMla, DsMlaScale::kRaw, true);
  raw.name = "fp8_ds_mla_raw";
  v.push_back(raw);
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16})
    for (int64_t m : {0, 4}) {
      CopyCase c;
      c.fmt = make_fmt(f, DsMlaScale::kPow2, true, f == KvFormat::kFp8 ? 0.0371f : 1.0f);
      c.misalign = m;
      c.own_index_slots = true;
      c.name = fmt::format("{}_own_index_slots_{}", to_string(f), m ? "misaligned" : "aligned");
      v.push_back(c);
    }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CombineInsertKernels, ::testing::ValuesIn(copy_cases()), copy_name);

TEST(AllGatherKernel, EveryRankGetsEveryRankRankMajor) {
  REQUIRE_GPU();
  for (int W : {1, 3, 8, 11}) {
    const int64_t bytes = 16 * 1237;
    std::vector<DeviceBuffer> src, dst;
    std::vector<std::vector<uint8_t>> host(static_cast<size_t>(W));
    std::vector<const void*> sp;
    std::vector<void*> dp;
    for (int r = 0; r < W; ++r) {
      host[static_cast<size_t>(r)].resize(bytes);
      for (int64_t i = 0; i < bytes; ++i) host[static_cast<size_t>(r)][static_cast<size_t>(i)] = static_cast<uint8_t>(test::hash64(r, i));
      src.push_back(upload(host[static_cast<size_t>(r)]));
      dst.emplace_back(W * bytes);
      sp.push_back(src.back().data());
      dp.push_back(dst.back().data());
    }
    cuda::launch_all_gather(sp, dp, bytes, nullptr);
    PCPKV_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> want;
    for (int r = 0; r < W; ++r) want.insert(want.end(), host[static_cast<size_t>(r)].begin(), host[static_cast<size_t>(r)].end());
    for (int p = 0; p < W; ++p)
      EXPECT_TRUE(test::bytes_equal(want, dst[static_cast<size_t>(p)].download<uint8_t>(W * bytes), fmt::format("W {} rank {}", W, p)));
  }
}

}  // namespace
}  // namespace pcpkv
