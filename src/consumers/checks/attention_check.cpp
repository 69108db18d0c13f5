// End-to-end consumer check (SPEC section 6): PCP-P publication + per-rank indexer and sparse attention
// == one-rank run, byte for byte; DCP shards + LSE merge == one-rank within SparseMlaBound.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "consumers/checks/attention_check_internal.h"
#include "pcpkv/consumers/attention_check.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs.h"

namespace pcpkv {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

/// Block tables of a plan as one padded int32 table [num_requests, stride] (unused entries -1).
struct Tables {
  std::vector<int32_t> data;
  int64_t stride = 1;
};
Tables flatten_tables(const PcpPlan& plan) {
  Tables t;
  for (const auto& bt : plan.block_tables) t.stride = std::max<int64_t>(t.stride, static_cast<int64_t>(bt.size()));
  t.data.assign(plan.block_tables.size() * t.stride, -1);
  for (size_t r = 0; r < plan.block_tables.size(); ++r)
    std::copy(plan.block_tables[r].begin(), plan.block_tables[r].end(), t.data.begin() + r * t.stride);
  return t;
}

int64_t slot_of(const PcpPlan& plan, int32_t req, int64_t pos) {
  const auto& bt = plan.block_tables[req];
  PCPKV_CHECK(pos / plan.block_size < static_cast<int64_t>(bt.size()),
              "attention check: request {} position {} has no block in its table ({} blocks)", req, pos, bt.size());
  return int64_t{bt[pos / plan.block_size]} * plan.block_size + pos % plan.block_size;
}

/// Writes seeded rows into every replica of `pub` at the context positions (< context_len) of every
/// request; the rows depend on (request, position) only, so every plan gets the same cache contents.
int64_t fill_context(PublishResult& pub, const PcpPlan& plan, const CacheFormat& fmt, uint64_t seed) {
  int64_t rows = 0;
  const int64_t mla_row = mla_row_bytes(fmt.kv_format);
  std::vector<uint8_t> mla(mla_row), idx(128), scale(4);
  for (size_t r = 0; r < plan.requests.size(); ++r) {
    for (int64_t pos = 0; pos < plan.requests[r].context_len; ++pos) {
      attention_inputs::Rng rng{seed ^ (0x9e37ull * (r + 1)) ^ (static_cast<uint64_t>(pos) << 20)};
      float kv_c[512], k_pe[64], k[128];
      attention_inputs::random_row(rng, kv_c, 512, 1.0, 3);
      attention_inputs::random_row(rng, k_pe, 64, 1.0, 4);
      attention_inputs::random_row(rng, k, 128, 1.0, 5);
      attention_inputs::encode_mla_row(kv_c, k_pe, fmt, mla.data());
      attention_inputs::encode_index_row(k, idx.data(), scale.data());
      const int64_t slot = slot_of(plan, static_cast<int32_t>(r), pos);
      for (size_t w = 0; w < pub.mla_alloc.size(); ++w) {
        std::memcpy(pub.mla_alloc[w].data() + pub.mla_cache_offset + pub.mla_geometry.row_offset(slot), mla.data(),
                    mla_row);
        uint8_t* ib = pub.index_alloc[w].data() + pub.index_cache_offset;
        std::memcpy(ib + pub.index_geometry.data_offset(slot), idx.data(), 128);
        std::memcpy(ib + pub.index_geometry.scale_offset(slot), scale.data(), 4);
      }
      ++rows;
    }
  }
  return rows;
}

/// One serving problem: a list of global tokens (-1 = padding) on one replica.
struct Served {
  int64_t num_tokens = 0;
  std::vector<int64_t> global_index;
  std::vector<int32_t> topk_slots, topk_pos;  // [M, topk]
  std::vector<float> scores;                  // [M, max_keys] (when asked)
  std::vector<int32_t> num_keys;              // [M]
  std::vector<float> out, lse;                // [M, Hq, 512], [M, Hq]
  SparseMlaRefStats stats;                    // reference runs only
};

struct Problem {
  const ModelConfig* model;
  const AttentionCheckConfig* cfg;
  const ConsumerQueries* queries;
  int64_t max_keys;
};

/// Runs the indexer then sparse attention for `tokens` on replica `rank` of `pub`.
Served serve(const Problem& pr, const PcpPlan& plan, const PublishResult& pub, int32_t rank,
             const std::vector<int64_t>& tokens, ConsumerKernels& kernels, bool want_scores, bool reference,
             AttentionCheckReport* rep) {
  const ConsumerQueries& qs = *pr.queries;
  const int32_t Hi = qs.index_heads, Hq = qs.heads, topk = pr.cfg->topk;
  Served s;
  s.num_tokens = static_cast<int64_t>(tokens.size());
  s.global_index = tokens;
  const int64_t M = s.num_tokens;
  const size_t m = static_cast<size_t>(M);
  std::vector<uint8_t> q_fp8(m * Hi * 128, 0);
  std::vector<float> q_scale(m * Hi, 1.0f);
  std::vector<float> weights(m * Hi, 0.5f);
  std::vector<int64_t> positions(m, 0);
  std::vector<int32_t> request_idx(m, -1);
  std::vector<uint16_t> q(m * Hq * 576, 0);
  for (int64_t i = 0; i < M; ++i) {
    const int64_t g = tokens[i];
    if (g < 0) {
      // Padding row: junk queries (engines leave garbage there); request -1 keeps it out.
      std::fill(q_fp8.begin() + i * Hi * 128, q_fp8.begin() + (i + 1) * Hi * 128, uint8_t{0x3c});
      std::fill(q.begin() + i * Hq * 576, q.begin() + (i + 1) * Hq * 576, uint16_t{0x3f80});
      continue;
    }
    std::copy_n(qs.index_q_fp8.begin() + g * Hi * 128, Hi * 128, q_fp8.begin() + i * Hi * 128);
    std::copy_n(qs.index_q_scale.begin() + g * Hi, Hi, q_scale.begin() + i * Hi);
    std::copy_n(qs.index_weights.begin() + g * Hi, Hi, weights.begin() + i * Hi);
    std::copy_n(qs.q.begin() + g * Hq * 576, Hq * 576, q.begin() + i * Hq * 576);
    positions[i] = plan.global_positions[g];
    request_idx[i] = plan.global_request[g];
  }
  const Tables tables = flatten_tables(plan);

  IndexerParams ip;
  ip.num_tokens = M;
  ip.num_heads = Hi;
  ip.q_fp8 = q_fp8.data();
  ip.q_scale = q_scale.data();
  ip.weights = weights.data();
  ip.positions = positions.data();
  ip.request_idx = request_idx.data();
  ip.block_tables = tables.data.data();
  ip.num_requests = static_cast<int32_t>(plan.block_tables.size());
  ip.block_table_stride = tables.stride;
  ip.index_cache = pub.index_alloc[rank].data() + pub.index_cache_offset;
  ip.geometry = pub.index_geometry;
  ip.topk = topk;
  ip.max_keys = pr.max_keys;
  s.topk_slots.assign(M * topk, 0x5a5a5a5a);  // poisoned: every entry must be written
  s.topk_pos.assign(M * topk, 0x5a5a5a5a);
  ip.topk_slots = s.topk_slots.data();
  ip.topk_positions = s.topk_pos.data();
  if (want_scores) {
    s.scores.assign(M * pr.max_keys, std::numeric_limits<float>::quiet_NaN());
    ip.scores = s.scores.data();
  }
  auto t0 = Clock::now();
  if (reference)
    indexer_reference(ip);
  else
    kernels.indexer(ip);
  if (rep && !reference) rep->indexer_ms += ms_since(t0);

  SparseMlaParams ap;
  ap.num_tokens = M;
  ap.num_heads = Hq;
  ap.q = q.data();
  ap.mla_cache = pub.mla_alloc[rank].data() + pub.mla_cache_offset;
  ap.geometry = pub.mla_geometry;
  ap.fmt = pr.cfg->fmt;
  ap.indices = s.topk_slots.data();
  ap.topk = topk;
  ap.softmax_scale = sparse_mla_softmax_scale(pr.model->softmax_scale());
  float poison;
  const uint32_t pb = 0xa5a5a5a5u;
  std::memcpy(&poison, &pb, 4);
  s.out.assign(M * Hq * 512, poison);
  s.lse.assign(M * Hq, poison);
  ap.out = s.out.data();
  ap.lse = s.lse.data();
  t0 = Clock::now();
  if (reference)
    sparse_mla_reference(ap, &s.stats);
  else
    kernels.sparse_mla(ap);
  if (rep && !reference) rep->attention_ms += ms_since(t0);
  s.num_keys.resize(M);
  for (int64_t i = 0; i < M; ++i)
    s.num_keys[i] = static_cast<int32_t>(std::count_if(s.topk_slots.begin() + i * topk,
                                                       s.topk_slots.begin() + (i + 1) * topk,
                                                       [](int32_t v) { return v >= 0; }));
  return s;
}

void note(AttentionCheckReport& rep, const std::string& what) {
  if (rep.first_problem.empty()) rep.first_problem = what;
}

/// Gathered results in global token order.
struct Gathered {
  std::vector<int32_t> topk_pos;
  std::vector<float> out, lse;
  std::vector<char> filled;
};

void gather(const Served& s, int32_t topk, int32_t Hq, Gathered& g, AttentionCheckReport& rep, int32_t rank) {
  for (int64_t i = 0; i < s.num_tokens; ++i) {
    const int64_t gi = s.global_index[i];
    const int32_t* tp = s.topk_pos.data() + i * topk;
    const float* o = s.out.data() + i * Hq * 512;
    const float* l = s.lse.data() + i * Hq;
    if (gi < 0) {
      bool ok = std::all_of(tp, tp + topk, [](int32_t v) { return v == -1; });
      ok = ok && std::all_of(o, o + Hq * 512, [](float v) { return float_bits(v) == 0u; });
      ok = ok && std::all_of(l, l + Hq, [](float v) { return v == -std::numeric_limits<float>::infinity(); });
      if (!ok) {
        ++rep.padding_rows_bad;
        note(rep, fmt::format("rank {} padded local row {} is not (-1 top-k, zero out, -inf lse)", rank, i));
      }
      continue;
    }
    if (!g.filled[gi]) {
      g.filled[gi] = 1;
      std::copy(tp, tp + topk, g.topk_pos.begin() + gi * topk);
      std::copy(o, o + Hq * 512, g.out.begin() + gi * Hq * 512);
      std::copy(l, l + Hq, g.lse.begin() + gi * Hq);
      continue;
    }
    // A replicated decode token: every rank's copy must agree bit for bit.
    const bool same = std::equal(tp, tp + topk, g.topk_pos.begin() + gi * topk) &&
                      std::memcmp(o, g.out.data() + gi * Hq * 512, Hq * 512 * 4) == 0 &&
                      std::memcmp(l, g.lse.data() + gi * Hq, Hq * 4) == 0;
    if (!same) {
      ++rep.decode_copies_diff;
      note(rep, fmt::format("global token {}: rank {}'s decode copy differs from an earlier rank's", gi, rank));
    }
  }
}

/// DCP: the one-rank replica sharded over D ranks by position groups; returns merged out/lse in
/// global order.
void run_dcp(const Problem& pr, const PcpPlan& plan, const PublishResult& pub, const Served& one,
             ConsumerKernels& kernels, AttentionCheckReport& rep, std::vector<float>& merged_out,
             std::vector<float>& merged_lse) {
  const int32_t D = pr.cfg->dcp_world, I = pr.cfg->dcp_interleave, topk = pr.cfg->topk;
  const int32_t Hq = pr.queries->heads;
  const int64_t N = one.num_tokens;
  const CacheFormat& fmt = pr.cfg->fmt;
  const int64_t row_bytes = mla_row_bytes(fmt.kv_format);
  const int32_t bs = plan.block_size;
  // Assign every cached (request, position) to its shard and a dense local slot there.
  std::vector<int32_t> shard_of(plan.num_slots(), -1), local_of(plan.num_slots(), -1);
  std::vector<int64_t> count(D, 0);
  std::vector<std::vector<int64_t>> rows_of(D);  // global slots, in local order
  for (size_t r = 0; r < plan.requests.size(); ++r) {
    const int64_t len = plan.requests[r].context_len + plan.requests[r].num_new_tokens;
    for (int64_t pos = 0; pos < len; ++pos) {
      const int32_t d = static_cast<int32_t>((pos / I) % D);
      const int64_t slot = slot_of(plan, static_cast<int32_t>(r), pos);
      shard_of[slot] = d;
      local_of[slot] = static_cast<int32_t>(count[d]++);
      rows_of[d].push_back(slot);
    }
  }
  const uint8_t* full = pub.mla_alloc[0].data() + pub.mla_cache_offset;
  std::vector<float> outs(static_cast<size_t>(D) * N * Hq * 512), lses(static_cast<size_t>(D) * N * Hq);
  for (int32_t d = 0; d < D; ++d) {
    MlaCacheGeometry g;
    g.block_size = bs;
    g.num_blocks = std::max<int64_t>(1, (count[d] + bs - 1) / bs);
    g.row_stride = row_bytes;
    g.block_stride = row_bytes * bs;
    std::vector<uint8_t> cache(g.bytes(), kGuardByte);
    for (int64_t i = 0; i < count[d]; ++i)
      std::memcpy(cache.data() + g.row_offset(i), full + pub.mla_geometry.row_offset(rows_of[d][i]), row_bytes);
    std::vector<int32_t> idx(N * topk, -1);
    for (int64_t t = 0; t < N; ++t) {
      int64_t num = 0;
      for (int32_t k = 0; k < topk; ++k) {
        const int32_t s = one.topk_slots[t * topk + k];
        if (s >= 0 && shard_of[s] == d) {
          idx[t * topk + k] = local_of[s];
          ++num;
        }
      }
      if (num == 0) ++rep.dcp_empty_shard_rows;
    }
    // `one` served the tokens in global order, so the queries are the global ones.
    SparseMlaParams ap;
    ap.num_tokens = N;
    ap.num_heads = Hq;
    ap.q = pr.queries->q.data();
    ap.mla_cache = cache.data();
    ap.geometry = g;
    ap.fmt = fmt;
    ap.indices = idx.data();
    ap.topk = topk;
    ap.softmax_scale = sparse_mla_softmax_scale(pr.model->softmax_scale());
    ap.out = outs.data() + static_cast<size_t>(d) * N * Hq * 512;
    ap.lse = lses.data() + static_cast<size_t>(d) * N * Hq;
    auto t0 = Clock::now();
    kernels.sparse_mla(ap);
    rep.attention_ms += ms_since(t0);
  }
  merged_out.assign(N * Hq * 512, 0.0f);
  merged_lse.assign(N * Hq, 0.0f);
  LseMergeParams mp;
  mp.num_shards = D;
  mp.num_rows = N * Hq;
  mp.head_dim = 512;
  mp.outs = outs.data();
  mp.lses = lses.data();
  mp.out = merged_out.data();
  mp.lse = merged_lse.data();
  auto t0 = Clock::now();
  kernels.lse_merge(mp);
  rep.merge_ms += ms_since(t0);
}

/// Counts values outside SparseMlaBound; updates max ratio and the first problem.
void bound_check(const Served& ref, const float* out, const float* lse, int32_t Hq, int dcp_shards,
                 SparseMlaArith arith, const float* other_out, const float* other_lse, int64_t* over,
                 double* max_ratio, AttentionCheckReport& rep, const char* what) {
  // ref: fp64 reference (stats, values); other_*: the fp32 result the bound is against (ref itself for
  // the reference check; the one-rank fp32 result for DCP).
  for (int64_t t = 0; t < ref.num_tokens; ++t)
    for (int32_t h = 0; h < Hq; ++h) {
      const int64_t th = t * Hq + h;
      const double ref_lse = ref.lse[th];
      const double ms = ref.stats.max_abs_s[th];
      const int32_t K = ref.stats.num_keys[t];
      if (std::isinf(ref_lse) || std::isinf(other_lse[th])) {
        // No key: both sides must say -inf exactly (and the outputs below must be zero).
        if (!(lse[th] == other_lse[th] && std::isinf(lse[th]))) {
          ++*over;
          note(rep, fmt::format("{}: token {} head {}: lse {} vs {}", what, t, h, lse[th], other_lse[th]));
        }
      } else {
        const double lb = SparseMlaBound::lse_bound(ms, K, ref_lse, dcp_shards, arith);
        const double le = std::fabs(static_cast<double>(lse[th]) - other_lse[th]);
        *max_ratio = std::max(*max_ratio, le / lb);
        if (!(le <= lb)) {
          ++*over;
          note(rep, fmt::format("{}: token {} head {}: lse {} vs {} (bound {:.3g})", what, t, h, lse[th],
                                other_lse[th], lb));
        }
      }
      for (int d = 0; d < 512; ++d) {
        const double b = SparseMlaBound::out_bound(ref.stats.abs_pv[th * 512 + d], ms, K, ref.out[th * 512 + d],
                                                   ref_lse, dcp_shards, arith);
        const double e = std::fabs(static_cast<double>(out[th * 512 + d]) - other_out[th * 512 + d]);
        *max_ratio = std::max(*max_ratio, e / b);
        if (!(e <= b)) {
          ++*over;
          note(rep, fmt::format("{}: token {} head {} dim {}: {} vs {} (bound {:.3g})", what, t, h, d,
                                out[th * 512 + d], other_out[th * 512 + d], b));
        }
      }
    }
}

}  // namespace

AttentionCheckReport run_attention_check(const AttentionCheckConfig& cfg, const ModelConfig& model,
                                         Backend& publisher, ConsumerKernels& consumers) {
  PCPKV_CHECK(cfg.fmt.has_indexer, "attention check: the layer needs an indexer (fmt.has_indexer = false)");
  PCPKV_CHECK(cfg.topk >= 1 && cfg.topk <= 8192, "attention check: topk must be in [1, 8192], got {}", cfg.topk);
  PCPKV_CHECK(cfg.dcp_world >= 1 && cfg.dcp_world <= 64, "attention check: dcp_world must be in [1, 64], got {}",
              cfg.dcp_world);
  PCPKV_CHECK(cfg.dcp_interleave >= 1, "attention check: dcp_interleave must be >= 1, got {}", cfg.dcp_interleave);
  model.validate();
  AttentionCheckReport rep;
  rep.pcp_world = cfg.plan.pcp_world;

  PlanConfig one_cfg = cfg.plan;
  one_cfg.pcp_world = 1;
  const PcpPlan plan_p = make_plan(cfg.plan);
  const PcpPlan plan_1 = make_plan(one_cfg);
  const int64_t N = plan_p.num_global_tokens();
  PCPKV_CHECK(plan_1.num_global_tokens() == N && plan_1.global_positions == plan_p.global_positions &&
                  plan_1.global_request == plan_p.global_request,
              "attention check: the one-rank plan orders the batch differently from the PCP plan");
  rep.num_tokens = N;
  const GlobalInputs inputs = generate_inputs(model, plan_p, true, cfg.seed);

  PublishSetup setup;
  setup.model = &model;
  setup.fmt = cfg.fmt;
  setup.materialize_q = false;
  setup.plan = &plan_p;
  PublishResult pub_p = publisher.publish(setup, inputs, cfg.transport);
  setup.plan = &plan_1;
  PublishResult pub_1 = publisher.publish(setup, inputs, cfg.transport);
  rep.num_context_rows = fill_context(pub_p, plan_p, cfg.fmt, cfg.seed);
  fill_context(pub_1, plan_1, cfg.fmt, cfg.seed);

  const ConsumerQueries queries = generate_queries(N, static_cast<int32_t>(model.index_n_heads),
                                                   static_cast<int32_t>(model.num_attention_heads),
                                                   cfg.seed ^ 0xc0ffeeull);
  int64_t max_pos = 0;
  for (int64_t p : plan_p.global_positions) max_pos = std::max(max_pos, p);
  Problem pr{&model, &cfg, &queries, max_pos + 1};
  const int32_t topk = cfg.topk, Hq = queries.heads;

  // Global-order one-rank run (also the reference problem's token order).
  std::vector<int64_t> all(N);
  for (int64_t i = 0; i < N; ++i) all[i] = i;
  const Served one = serve(pr, plan_1, pub_1, 0, all, consumers, cfg.check_reference, false, &rep);

  // PCP-P: every rank its own local tokens (padding included) on its own replica.
  Gathered g;
  g.topk_pos.assign(N * topk, -2);
  g.out.assign(N * Hq * 512, 0.0f);
  g.lse.assign(N * Hq, 0.0f);
  g.filled.assign(N, 0);
  for (int32_t r = 0; r < plan_p.pcp_world; ++r) {
    const Served s = serve(pr, plan_p, pub_p, r, plan_p.ranks[r].global_index, consumers, false, false, &rep);
    gather(s, topk, Hq, g, rep, r);
  }
  for (int64_t i = 0; i < N; ++i) {
    if (!g.filled[i]) {
      ++rep.topk_rows_diff;
      note(rep, fmt::format("global token {} is served by no rank", i));
      continue;
    }
    if (!std::equal(g.topk_pos.begin() + i * topk, g.topk_pos.begin() + (i + 1) * topk,
                    one.topk_pos.begin() + i * topk)) {
      ++rep.topk_rows_diff;
      note(rep, fmt::format("global token {}: PCP top-k positions differ from the one-rank run", i));
    }
    for (int64_t k = i * Hq * 512; k < (i + 1) * Hq * 512; ++k)
      if (float_bits(g.out[k]) != float_bits(one.out[k])) {
        if (rep.out_bytes_diff++ == 0)
          note(rep, fmt::format("global token {}: out[{}] {} vs one-rank {}", i, k % (Hq * 512), g.out[k], one.out[k]));
      }
    for (int64_t k = i * Hq; k < (i + 1) * Hq; ++k)
      if (float_bits(g.lse[k]) != float_bits(one.lse[k])) {
        if (rep.lse_bytes_diff++ == 0)
          note(rep, fmt::format("global token {}: lse[{}] {} vs one-rank {}", i, k % Hq, g.lse[k], one.lse[k]));
      }
  }

  // The CPU reference of the one-rank problem (needed for the DCP bound too).
  if (cfg.check_reference || cfg.dcp_world > 1) {
    const Served ref = serve(pr, plan_1, pub_1, 0, all, consumers, true, true, nullptr);
    if (cfg.check_reference) {
      rep.reference_checked = true;
      for (int64_t i = 0; i < N; ++i) {
        if (!std::equal(ref.topk_pos.begin() + i * topk, ref.topk_pos.begin() + (i + 1) * topk,
                        one.topk_pos.begin() + i * topk)) {
          ++rep.ref_topk_rows_diff;
          note(rep, fmt::format("global token {}: {} top-k differs from the CPU reference", i, consumers.name()));
        }
        const int64_t len = plan_1.global_positions[i] + 1;
        for (int64_t j = 0; j < len; ++j)
          if (float_bits(ref.scores[i * pr.max_keys + j]) != float_bits(one.scores[i * pr.max_keys + j])) {
            if (rep.ref_scores_diff++ == 0)
              note(rep, fmt::format("global token {} key {}: score {} vs reference {}", i, j,
                                    one.scores[i * pr.max_keys + j], ref.scores[i * pr.max_keys + j]));
          }
      }
      bound_check(ref, one.out.data(), one.lse.data(), Hq, 0, consumers.attention_arith(), ref.out.data(),
                  ref.lse.data(), &rep.ref_over_bound, &rep.ref_max_ratio, rep, "reference");
    }
    if (cfg.dcp_world > 1) {
      rep.dcp_checked = true;
      std::vector<float> mo, ml;
      run_dcp(pr, plan_1, pub_1, one, consumers, rep, mo, ml);
      bound_check(ref, mo.data(), ml.data(), Hq, cfg.dcp_world, consumers.attention_arith(), one.out.data(),
                  one.lse.data(), &rep.dcp_over_bound, &rep.dcp_max_ratio, rep, "dcp");
    }
  }
  return rep;
}

bool AttentionCheckReport::passed() const {
  return topk_rows_diff == 0 && out_bytes_diff == 0 && lse_bytes_diff == 0 && decode_copies_diff == 0 &&
         padding_rows_bad == 0 && ref_topk_rows_diff == 0 && ref_scores_diff == 0 && ref_over_bound == 0 &&
         dcp_over_bound == 0;
}

std::string AttentionCheckReport::describe() const {
  std::string s = fmt::format("attention check, PCP {} vs 1 rank: {} tokens ({} context rows filled)\n", pcp_world,
                              num_tokens, num_context_rows);
  s += fmt::format("  PCP == one rank (bytes): top-k rows differing {}, out values {}, lse values {}, "
                   "decode copies {}, bad padded rows {}\n",
                   topk_rows_diff, out_bytes_diff, lse_bytes_diff, decode_copies_diff, padding_rows_bad);
  if (reference_checked)
    s += fmt::format("  vs CPU reference: top-k rows differing {}, scores differing {}, attention over bound {} "
                     "(max err/bound {:.3g})\n",
                     ref_topk_rows_diff, ref_scores_diff, ref_over_bound, ref_max_ratio);
  if (dcp_checked)
    s += fmt::format("  DCP shards + LSE merge vs one rank: over bound {} (max err/bound {:.3g}), "
                     "(token, shard) pairs with no key {}\n",
                     dcp_over_bound, dcp_max_ratio, dcp_empty_shard_rows);
  s += fmt::format("  consumer time (summed over ranks): indexer {:.2f} ms, attention {:.2f} ms, merge {:.2f} ms\n",
                   indexer_ms, attention_ms, merge_ms);
  s += passed() ? "  PASS\n" : fmt::format("  FAIL: {}\n", first_problem);
  return s;
}

}  // namespace pcpkv
