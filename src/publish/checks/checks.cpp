// The checks that prove a published cache right (pcpkv/publish/checks.h): untouched bytes, the FP8 bound
// against fp64 math of SPEC section 2, and a slot decoder (byte comparisons: checks_bytes.cpp).
#include "pcpkv/publish/checks.h"

#include <algorithm>
#include <cmath>

#include "pcpkv/device/codec.h"
#include "pcpkv/device/pack.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/rope.h"

namespace pcpkv {

// ---- check_untouched -------------------------------------------------------------------------------

namespace {

struct UntouchedScan {
  const std::vector<uint8_t>& buf;
  const char* name;
  int32_t rank;
  GuardReport& report;

  // Bytes [begin, end) must all be kGuardByte; `what` names the region for the first bad byte.
  template <class Describe>
  void expect_guard(int64_t begin, int64_t end, Describe what) {
    if (end <= begin) return;
    const ByteDiff d = compare_to_guard(buf.data() + begin, end - begin);
    if (d.equal()) return;
    const int64_t i = begin + d.first_diff;
    if (report.num_bad == 0)
      report.first = fmt::format("rank {} {} byte {} ({}) = 0x{:02x}, expected 0x{:02x}", rank, name, i, what(i),
                                 buf[static_cast<size_t>(i)], kGuardByte);
    report.num_bad += d.num_diff;
  }
};

}  // namespace

GuardReport check_untouched(const PublishResult& r, int32_t rank, const PcpPlan& plan, const CacheFormat& fmt) {
  PCPKV_CHECK(rank >= 0 && rank < static_cast<int32_t>(r.mla_alloc.size()) &&
                  rank < static_cast<int32_t>(r.index_alloc.size()),
              "check_untouched: rank {} is out of range [0, {})", rank, r.mla_alloc.size());
  const MlaCacheGeometry& mg = r.mla_geometry;
  const IndexerCacheGeometry& ig = r.index_geometry;
  const std::vector<uint8_t>& mla = r.mla_alloc[static_cast<size_t>(rank)];
  const std::vector<uint8_t>& idx = r.index_alloc[static_cast<size_t>(rank)];
  PCPKV_CHECK(static_cast<int64_t>(mla.size()) >= r.mla_cache_offset + mg.bytes(),
              "check_untouched: rank {} mla_alloc has {} B, the cache needs {} B from offset {}", rank, mla.size(),
              mg.bytes(), r.mla_cache_offset);
  PCPKV_CHECK(static_cast<int64_t>(idx.size()) >= r.index_cache_offset + ig.bytes(),
              "check_untouched: rank {} index_alloc has {} B, the cache needs {} B from offset {}", rank, idx.size(),
              ig.bytes(), r.index_cache_offset);
  const int64_t plan_index_slots = plan.indexer_blocks() * plan.block_size;
  PCPKV_CHECK(plan.num_slots() <= mg.num_slots() && plan_index_slots <= ig.num_slots(),
              "check_untouched: the plan has {} / {} slots, the caches {} / {}", plan.num_slots(), plan_index_slots,
              mg.num_slots(), ig.num_slots());

  std::vector<uint8_t> written(static_cast<size_t>(mg.num_slots()), 0);
  for (int64_t s : plan.gathered_slot_mapping)
    if (s >= 0) written[static_cast<size_t>(s)] = 1;
  // The indexer cache's written slots: its own mapping's (docs/spec.md 4.2), else the MLA cache's.
  std::vector<uint8_t> index_written;
  if (plan.has_index_slots()) {
    index_written.assign(static_cast<size_t>(ig.num_slots()), 0);
    for (int64_t s : plan.gathered_indexer_slot_mapping)
      if (s >= 0) index_written[static_cast<size_t>(s)] = 1;
  }
  const std::vector<uint8_t>& iwritten = plan.has_index_slots() ? index_written : written;

  GuardReport report;
  const int64_t row_bytes = mla_row_bytes(fmt.kv_format);
  {
    UntouchedScan scan{mla, "mla_alloc", rank, report};
    const int64_t base = r.mla_cache_offset;
    scan.expect_guard(0, base, [](int64_t) { return std::string("before the cache: guard or base offset"); });
    for (int64_t b = 0; b < mg.num_blocks; ++b) {
      const int64_t block = base + b * mg.block_stride;
      for (int64_t o = 0; o < mg.block_size; ++o) {
        const int64_t slot = b * mg.block_size + o;
        const int64_t row = block + o * mg.row_stride;
        if (written[static_cast<size_t>(slot)])
          scan.expect_guard(row + row_bytes, row + mg.row_stride,
                            [&](int64_t) { return fmt::format("row padding of slot {}", slot); });
        else
          scan.expect_guard(row, row + mg.row_stride, [&](int64_t i) {
            return fmt::format("slot {} the plan does not write, row byte {}", slot, i - row);
          });
      }
      scan.expect_guard(block + mg.block_size * mg.row_stride, block + mg.block_stride,
                        [&](int64_t) { return fmt::format("padding of block {}", b); });
    }
    scan.expect_guard(base + mg.bytes(), static_cast<int64_t>(mla.size()),
                      [](int64_t) { return std::string("after the cache: guard"); });
  }
  {
    UntouchedScan scan{idx, "index_alloc", rank, report};
    const int64_t base = r.index_cache_offset;
    if (!fmt.has_indexer) {
      scan.expect_guard(0, static_cast<int64_t>(idx.size()),
                        [](int64_t) { return std::string("indexer cache of a layer without an indexer"); });
    } else {
      scan.expect_guard(0, base, [](int64_t) { return std::string("before the cache: guard or base offset"); });
      for (int64_t b = 0; b < ig.num_blocks; ++b) {
        const int64_t block = base + b * ig.block_stride;
        for (int64_t o = 0; o < ig.block_size; ++o) {
          const int64_t slot = b * ig.block_size + o;
          if (iwritten[static_cast<size_t>(slot)]) continue;
          const int64_t data = block + o * kIndexHeadDim;
          const int64_t scale = block + int64_t{ig.block_size} * kIndexHeadDim + o * 4;
          scan.expect_guard(data, data + kIndexHeadDim,
                            [&](int64_t) { return fmt::format("indexer data of unwritten slot {}", slot); });
          scan.expect_guard(scale, scale + 4,
                            [&](int64_t) { return fmt::format("indexer scale of unwritten slot {}", slot); });
        }
        scan.expect_guard(block + int64_t{ig.block_size} * kIndexerSlotBytes, block + ig.block_stride,
                          [&](int64_t) { return fmt::format("padding of indexer block {}", b); });
      }
      scan.expect_guard(base + ig.bytes(), static_cast<int64_t>(idx.size()),
                        [](int64_t) { return std::string("after the cache: guard"); });
    }
  }
  return report;
}

// ---- decode_slot -----------------------------------------------------------------------------------

namespace {

// The indexer row at `slot` of the indexer cache into d (index_k dequantized, index_scale).
void decode_index_row(const uint8_t* index_cache, const IndexerCacheGeometry& ig, int64_t slot, DecodedRow& d) {
  PCPKV_CHECK(slot >= 0 && slot < ig.num_slots(), "decode_slot: slot {} is out of the indexer cache's range [0, {})",
              slot, ig.num_slots());
  d.index_scale = pack::load_f32_le(index_cache + ig.scale_offset(slot));
  const uint8_t* data = index_cache + ig.data_offset(slot);
  for (int i = 0; i < 128; ++i) d.index_k[i] = codec::e4m3_to_float(data[i]) * d.index_scale;
}

}  // namespace

DecodedRow decode_slot(const uint8_t* mla_cache, const MlaCacheGeometry& mg, const uint8_t* index_cache,
                       const IndexerCacheGeometry& ig, const CacheFormat& fmt, int64_t slot) {
  PCPKV_CHECK(mla_cache != nullptr, "decode_slot: mla_cache is null");
  PCPKV_CHECK(slot >= 0 && slot < mg.num_slots(), "decode_slot: slot {} is out of range [0, {})", slot,
              mg.num_slots());
  DecodedRow d{};
  const uint8_t* row = mla_cache + mg.row_offset(slot);
  switch (fmt.kv_format) {
    case KvFormat::kBf16:
      for (int i = 0; i < 512; ++i) d.kv_c[i] = codec::bf16_to_float(pack::load_u16_le(row + 2 * i));
      for (int i = 0; i < 64; ++i) d.k_pe[i] = codec::bf16_to_float(pack::load_u16_le(row + 1024 + 2 * i));
      std::fill(d.tile_scales, d.tile_scales + 4, 1.0f);
      break;
    case KvFormat::kFp8:
      for (int i = 0; i < 512; ++i) d.kv_c[i] = codec::e4m3_to_float(row[i]) * fmt.k_scale;
      for (int i = 0; i < 64; ++i) d.k_pe[i] = codec::e4m3_to_float(row[512 + i]) * fmt.k_scale;
      std::fill(d.tile_scales, d.tile_scales + 4, fmt.k_scale);
      break;
    case KvFormat::kFp8DsMla:
      for (int k = 0; k < 4; ++k) d.tile_scales[k] = pack::load_f32_le(row + kDsMlaScaleOffset + 4 * k);
      for (int i = 0; i < 512; ++i) d.kv_c[i] = codec::e4m3_to_float(row[kDsMlaKvcOffset + i]) * d.tile_scales[i / 128];
      for (int i = 0; i < 64; ++i) d.k_pe[i] = codec::bf16_to_float(pack::load_u16_le(row + kDsMlaKpeOffset + 2 * i));
      break;
  }
  if (fmt.has_indexer && index_cache != nullptr) decode_index_row(index_cache, ig, slot, d);
  return d;
}

// ---- check_fp8_bound ---------------------------------------------------------------------------------
//
// Bound, per value v stored in the cache, against the fp64 value x of the SPEC section 2 formulas:
//   E4M3 values (x / s rounded to e4m3, s the value's scale: tile scale, k_scale, or indexer scale):
//     |dequant - x| <= 2^-4 * |x| + 2^-10 * s           (+ 2^-8 * |x| when the path rounds to bf16 first)
//   because round-to-nearest with 3 mantissa bits errs by at most half an ulp, < |x| / 17 < 2^-4 |x| for
//   normals, and by half the subnormal step 2^-9 * s = 2^-10 * s below 2^-6 * s; a bf16 rounding first adds
//   2^-8 |x| (7 mantissa bits), and |x|/17 * (1 + 2^-8) + 2^-8 |x| still fits under (2^-4 + 2^-8) |x|. The
//   slack between 1/17 and 1/16 (and the 2^-10 s term) covers the fp32 arithmetic error of the kernels.
//   bf16 values (k_pe of fp8_ds_mla and bf16 rows, kv_c of bf16 rows):
//     |dequant - x| <= 2^-8 * |x| + 2^-16 * amax
//   amax = max |x| over the value's group (its token's 512 kv_c or 64 k_pe): half an ulp is at most 2^-8 |x|
//   relative, and the absolute term covers fp32 RoPE cancellation (x0*c - x1*s errs by a few ulps of the
//   pair's magnitude, which can be far larger than |x|); it is ~2^-16 of the group and catches every real bug.
//   Saturated values (|x| > 448 * s, static fp8 only: the ds_mla and indexer scales are >= amax / 448) are
//   counted apart and not against the bound.
// The scales are checked too (a wrong scale would widen the bound): power-of-two scales must lie in
// [l, 2l] (l = the SPEC lower bound from the exact amax, widened by 2^-7 for fp32/bf16 rounding of amax),
// raw scales within 2^-7 of amax / 448. A scale outside counts as one value over the bound.

namespace {

struct Exact {
  double kv_c[512];
  double k_pe[64];
  double index_k[128];
};

double bf16d(uint16_t h) { return static_cast<double>(codec::bf16_to_float(h)); }

void rope_exact64(double* x, const long double* c, const long double* s, bool interleaved) {
  for (int i = 0; i < 32; ++i) {
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + 32;
    const long double x0 = x[a], x1 = x[b];
    x[a] = static_cast<double>(x0 * c[i] - x1 * s[i]);
    x[b] = static_cast<double>(x1 * c[i] + x0 * s[i]);
  }
}

void hadamard_exact(double* x) {
  for (int h = 1; h < 128; h <<= 1)
    for (int i = 0; i < 128; ++i)
      if ((i & h) == 0) {
        const double a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
  for (int i = 0; i < 128; ++i) x[i] /= std::sqrt(128.0);
}

struct BoundCheck {
  Fp8Report& rep;
  std::string where;  // "slot 12 (token 3, position 7)"

  void value(const char* tensor, int i, double got, double exact, double rel, double abs_term) {
    ++rep.num_values;
    const double err = std::fabs(got - exact);
    const double bound = rel * std::fabs(exact) + abs_term;
    const double ratio = std::isfinite(err) ? (bound > 0 ? err / bound : (err > 0 ? INFINITY : 0.0)) : INFINITY;
    if (std::isfinite(err)) rep.max_abs_err = std::max(rep.max_abs_err, err);
    if (ratio > 1.0) ++rep.num_over_bound;
    if (ratio > rep.max_err_over_bound) {
      rep.max_err_over_bound = ratio;
      rep.worst = fmt::format("{} {}[{}]: cache {:.8g}, exact {:.8g}, |err| {:.3g}, bound {:.3g}", where, tensor, i,
                              got, exact, err, bound);
    }
  }
  void e4m3(const char* tensor, int i, double got, double exact, double s, double bf16_extra, bool can_saturate) {
    if (can_saturate && std::fabs(exact) > 448.0 * s) {
      ++rep.num_values;
      ++rep.num_saturated;
      return;
    }
    // Below half the smallest E4M3 subnormal (2^-9 s) a static-scale value encodes as 0: counted, still checked.
    if (can_saturate && exact != 0.0 && std::fabs(exact) < 0x1p-10 * s) ++rep.num_flushed;
    value(tensor, i, got, exact, 0x1p-4 + bf16_extra, 0x1p-10 * s);
  }
  // A scale must lie in [lo, hi]; outside counts as one value over the bound.
  void scale(const char* what, double s, double lo, double hi, bool pow2) {
    int exponent = 0;
    const bool is_pow2 = !pow2 || (s > 0 && std::isfinite(s) && std::frexp(s, &exponent) == 0.5);
    double ratio = 1.0;
    if (!(s >= lo)) ratio = std::isfinite(lo / s) ? lo / s : INFINITY;
    if (!(s <= hi)) ratio = std::max(ratio, s / hi);
    if (!is_pow2) ratio = std::max(ratio, 2.0);
    if (ratio <= 1.0) return;
    ++rep.num_over_bound;
    if (ratio > rep.max_err_over_bound) {
      rep.max_err_over_bound = ratio;
      rep.worst = fmt::format("{} {}: scale {:.8g} outside [{:.8g}, {:.8g}]{}", where, what, s, lo, hi,
                              is_pow2 ? "" : " (not a power of two)");
    }
  }
};

double group_amax(const double* x, int n) {
  double a = 0.0;
  for (int i = 0; i < n; ++i) a = std::max(a, std::fabs(x[i]));
  return a;
}

}  // namespace

Fp8Report check_fp8_bound(const PublishResult& r, int32_t rank, const GlobalInputs& in, const PcpPlan& plan,
                          const ModelConfig& model, const CacheFormat& fmt, bool bf16_first) {
  PCPKV_CHECK(rank >= 0 && rank < static_cast<int32_t>(r.mla_alloc.size()),
              "check_fp8_bound: rank {} is out of range [0, {})", rank, r.mla_alloc.size());
  validate_inputs(in, model, plan, fmt.has_indexer);
  // With its own indexer blocks (docs/spec.md 4.2) a token's indexer row is read at its own slot.
  const bool own = plan.has_index_slots();
  PCPKV_CHECK(!own || plan.global_index_slots.size() == plan.global_slots.size(),
              "check_fp8_bound: the plan has {} global_index_slots for {} tokens", plan.global_index_slots.size(),
              plan.global_slots.size());
  const uint8_t* mla = r.mla_alloc[static_cast<size_t>(rank)].data() + r.mla_cache_offset;
  const uint8_t* idx = fmt.has_indexer ? r.index_alloc[static_cast<size_t>(rank)].data() + r.index_cache_offset
                                       : nullptr;
  // The same long double angle and magnitude as rope_exact(), with the inverse frequencies computed once
  // (rope_exact recomputes them per call, too slow for 10^6 pairs).
  const auto inv_freq = rope_inv_freq(model.rope);
  const long double mscale = rope_mscale(model.rope);
  const double bf16_extra = bf16_first ? 0x1p-8 : 0.0;
  const bool ds_mla = fmt.kv_format == KvFormat::kFp8DsMla;
  const bool pow2 = fmt.ds_mla_scale == DsMlaScale::kPow2;
  constexpr double kWiden = 0x1p-7;

  Fp8Report rep;
  Exact ex;
  long double cosv[32], sinv[32];
  const int64_t N = plan.num_global_tokens();
  for (int64_t g = 0; g < N; ++g) {
    const int64_t slot = plan.global_slots[static_cast<size_t>(g)];
    if (slot < 0) continue;
    const int64_t pos = plan.global_positions[static_cast<size_t>(g)];
    const int64_t islot = own ? plan.global_index_slots[static_cast<size_t>(g)] : slot;
    DecodedRow d = decode_slot(mla, r.mla_geometry, own ? nullptr : idx, r.index_geometry, fmt, slot);
    if (own && idx != nullptr) decode_index_row(idx, r.index_geometry, islot, d);
    BoundCheck chk{rep, own ? fmt::format("rank {} slot {} (indexer slot {}; token {}, position {})", rank, slot, islot,
                                          g, pos)
                            : fmt::format("rank {} slot {} (token {}, position {})", rank, slot, g, pos)};
    for (int i = 0; i < 32; ++i) {
      const long double a = static_cast<long double>(pos) * inv_freq[static_cast<size_t>(i)];
      cosv[i] = std::cos(a) * mscale;
      sinv[i] = std::sin(a) * mscale;
    }
    // kv_c = RMSNorm(kv) (SPEC 2.2)
    const uint16_t* kv = in.kv.data() + g * 512;
    double ss = 0.0;
    for (int i = 0; i < 512; ++i) ss += bf16d(kv[i]) * bf16d(kv[i]);
    const double rk = 1.0 / std::sqrt(ss / 512.0 + model.rms_norm_eps);
    for (int i = 0; i < 512; ++i) ex.kv_c[i] = bf16d(kv[i]) * rk * in.weights.kv_norm_w[static_cast<size_t>(i)];
    // k_pe = RoPE(k_pe) (SPEC 2.3)
    const uint16_t* kpe = in.k_pe.data() + g * 64;
    for (int i = 0; i < 64; ++i) ex.k_pe[i] = bf16d(kpe[i]);
    rope_exact64(ex.k_pe, cosv, sinv, model.mla_rope_interleave);

    const double kv_amax = group_amax(ex.kv_c, 512);
    const double kpe_amax = group_amax(ex.k_pe, 64);
    if (fmt.kv_format == KvFormat::kBf16) {
      for (int i = 0; i < 512; ++i) chk.value("kv_c", i, d.kv_c[i], ex.kv_c[i], 0x1p-8, 0x1p-16 * kv_amax);
    } else if (fmt.kv_format == KvFormat::kFp8) {
      for (int i = 0; i < 512; ++i) chk.e4m3("kv_c", i, d.kv_c[i], ex.kv_c[i], fmt.k_scale, bf16_extra, true);
      for (int i = 0; i < 64; ++i) chk.e4m3("k_pe", i, d.k_pe[i], ex.k_pe[i], fmt.k_scale, bf16_extra, true);
    } else {
      for (int k = 0; k < 4; ++k) {
        const double amax = group_amax(ex.kv_c + 128 * k, 128);
        const double s = d.tile_scales[k];
        const char* names[4] = {"tile scale 0", "tile scale 1", "tile scale 2", "tile scale 3"};
        if (pow2) {
          const double lo = std::max(amax / 448.0, 1e-4);
          chk.scale(names[k], s, lo * (1 - kWiden), 2 * lo * (1 + kWiden), true);
        } else {
          const double lo = std::max(amax / 448.0, 1.17549435e-38);
          chk.scale(names[k], s, lo * (1 - kWiden), lo * (1 + kWiden), false);
        }
        for (int i = 128 * k; i < 128 * (k + 1); ++i) chk.e4m3("kv_c", i, d.kv_c[i], ex.kv_c[i], s, bf16_extra, false);
      }
    }
    if (ds_mla || fmt.kv_format == KvFormat::kBf16)
      for (int i = 0; i < 64; ++i) chk.value("k_pe", i, d.k_pe[i], ex.k_pe[i], 0x1p-8, 0x1p-16 * kpe_amax);

    if (fmt.has_indexer) {
      // index_k = RoPE(LayerNorm(index_k)) on dims [0, 64) (+ Hadamard) (SPEC 2.4)
      const uint16_t* xk = in.index_k.data() + g * 128;
      double mu = 0.0;
      for (int i = 0; i < 128; ++i) mu += bf16d(xk[i]);
      mu /= 128.0;
      double var = 0.0;
      for (int i = 0; i < 128; ++i) var += (bf16d(xk[i]) - mu) * (bf16d(xk[i]) - mu);
      var /= 128.0;
      const double ri = 1.0 / std::sqrt(var + model.index_norm_eps);
      for (int i = 0; i < 128; ++i)
        ex.index_k[i] = (bf16d(xk[i]) - mu) * ri * in.weights.index_ln_w[static_cast<size_t>(i)] +
                        in.weights.index_ln_b[static_cast<size_t>(i)];
      rope_exact64(ex.index_k, cosv, sinv, model.indexer_rope_interleave);
      if (model.indexer_hadamard) hadamard_exact(ex.index_k);
      const double amax = group_amax(ex.index_k, 128);
      const double lo = std::max(amax, 1e-4) / 448.0;
      chk.scale("indexer scale", d.index_scale, lo * (1 - kWiden), 2 * lo * (1 + kWiden), true);
      for (int i = 0; i < 128; ++i)
        chk.e4m3("index_k", i, d.index_k[i], ex.index_k[i], d.index_scale, bf16_extra, false);
    }
  }
  return rep;
}

}  // namespace pcpkv
