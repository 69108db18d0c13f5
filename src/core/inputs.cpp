// Seeded LLM-like inputs, their validation, and per-rank views (pcpkv/core/inputs.h; load_inputs lives in
// inputs_io.cpp).
//
// Randomness is a stateless counter-based hash (splitmix64's finalizer keyed by (seed, tensor, index)), so
// every value depends only on its key: results do not depend on the number of threads or on the order of
// generation, and a PCP-1 and a PCP-8 plan over the same requests get the same global inputs.
#include <algorithm>
#include <cmath>
#include <thread>

#include "core/parallel.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/layout.h"

namespace pcpkv {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Tensor ids of the hash key (part of the format of generated inputs: changing them changes every value).
enum TensorId : uint64_t {
  kIdQc = 1, kIdKv = 2, kIdKpe = 3, kIdIndexK = 4,
  kIdQNormW = 10, kIdKvNormW = 11, kIdIndexLnW = 12, kIdIndexLnB = 13,
  kIdTokenScale = 20, kIdOutliers = 30, kIdJunk = 40,
};

struct Keyed {
  uint64_t key;
  Keyed(uint64_t seed, uint64_t tensor) : key(mix64(seed ^ mix64(tensor * kGolden + 0x1234567ull))) {}
  uint64_t operator()(uint64_t index) const { return mix64(key + (index + 1) * kGolden); }
};

// Approximately standard normal from one 64-bit hash: the sum of four 16-bit uniforms (Irwin-Hall, n = 4),
// centred and scaled; |z| <= 3.46. Cheap enough for 10^8 values; the heavy tails come from the per-token
// log-normal magnitudes and the outlier channels.
double approx_normal(uint64_t h) {
  const double s = static_cast<double>(h & 0xffff) + static_cast<double>((h >> 16) & 0xffff) +
                   static_cast<double>((h >> 32) & 0xffff) + static_cast<double>(h >> 48);
  return (s - 131070.0) / 37837.2;
}

// Exact standard normal (Box-Muller) for the few per-token draws.
double box_muller(uint64_t h) {
  const double u1 = (static_cast<double>(h >> 40) + 0.5) / 16777216.0;  // (0, 1)
  const double u2 = static_cast<double>(h & 0xffffff) / 16777216.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// 2-4 outlier channels of one tensor, 20-50x larger than the rest.
struct Outliers {
  int64_t channel[4] = {-1, -1, -1, -1};
  double factor[4] = {1, 1, 1, 1};
  int count = 0;
  double gain(int64_t c) const {
    for (int k = 0; k < count; ++k)
      if (channel[k] == c) return factor[k];
    return 1.0;
  }
};

Outliers make_outliers(uint64_t seed, uint64_t tensor, int64_t width) {
  const Keyed h(seed, kIdOutliers * 64 + tensor);
  Outliers o;
  o.count = 2 + static_cast<int>(h(0) % 3);
  for (int k = 0, draw = 1; k < o.count; ++draw) {
    const int64_t c = static_cast<int64_t>(h(static_cast<uint64_t>(draw)) % static_cast<uint64_t>(width));
    if (std::find(o.channel, o.channel + k, c) != o.channel + k) continue;
    o.channel[k] = c;
    o.factor[k] = 20.0 + static_cast<double>(h(1000 + static_cast<uint64_t>(k)) % 31);
    ++k;
  }
  return o;
}

uint16_t to_bf16(double v) { return codec::float_to_bf16(static_cast<float>(v)); }
float bf16_round(double v) { return codec::bf16_to_float(to_bf16(v)); }

// Fills rows [begin, end) of a [N, width] activation: z * base * token magnitude * outlier gain.
void fill_activation(std::vector<uint16_t>& out, uint64_t seed, uint64_t tensor, int64_t width, double base,
                     const std::vector<double>& token_scale, int64_t begin, int64_t end) {
  const Keyed h(seed, tensor);
  const Keyed ht(seed, kIdTokenScale * 64 + tensor);
  const Outliers o = make_outliers(seed, tensor, width);
  for (int64_t t = begin; t < end; ++t) {
    // Per-tensor variation around the token's shared magnitude.
    const double scale = base * token_scale[static_cast<size_t>(t)] * std::exp(0.2 * approx_normal(ht(t)));
    uint16_t* row = out.data() + t * width;
    for (int64_t c = 0; c < width; ++c) {
      double v = approx_normal(h(static_cast<uint64_t>(t * width + c))) * scale * o.gain(c);
      if (v == 0.0) v = scale * 1e-3;  // never an exact zero
      row[c] = to_bf16(v);
    }
  }
}

std::vector<float> make_weights(uint64_t seed, uint64_t tensor, int64_t n, double mean, double spread) {
  const Keyed h(seed, tensor);
  std::vector<float> w(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double v = mean + spread * approx_normal(h(static_cast<uint64_t>(i)));
    if (mean > 0.0) v = std::max(v, 0.05 * mean);  // norm weights stay positive, as in checkpoints
    if (v == 0.0) v = spread * 0.01 + 1e-3;
    w[static_cast<size_t>(i)] = bf16_round(v);  // checkpoint weights are bf16
  }
  return w;
}

bool bf16_nonfinite(uint16_t h) { return (h & 0x7f80u) == 0x7f80u; }

template <class T>
void check_size(const std::vector<T>& v, int64_t rows, int64_t width, const char* name) {
  PCPKV_CHECK(static_cast<int64_t>(v.size()) == rows * width,
              "inputs: {} has {} values, expected [{}, {}] = {}", name, v.size(), rows, width, rows * width);
}

}  // namespace

GlobalInputs generate_inputs(const ModelConfig& model, const PcpPlan& plan, bool has_indexer, uint64_t seed) {
  PCPKV_CHECK(model.q_lora_rank >= 8 && model.q_lora_rank % 8 == 0,
              "generate_inputs: q_lora_rank = {} must be a positive multiple of 8", model.q_lora_rank);
  const int64_t N = plan.num_global_tokens();
  PCPKV_CHECK(static_cast<int64_t>(plan.global_positions.size()) == N,
              "generate_inputs: plan has {} positions for {} tokens", plan.global_positions.size(), N);
  GlobalInputs in;
  in.num_tokens = N;
  in.q_lora_rank = model.q_lora_rank;
  in.positions = plan.global_positions;
  in.q_c.resize(static_cast<size_t>(N * model.q_lora_rank));
  in.kv.resize(static_cast<size_t>(N * kKvLoraRank));
  in.k_pe.resize(static_cast<size_t>(N * kRopeDims));
  if (has_indexer) in.index_k.resize(static_cast<size_t>(N * kIndexHeadDim));

  // Per-token log-normal magnitude shared by the token's tensors (hidden-state norms vary by token).
  std::vector<double> token_scale(static_cast<size_t>(N));
  const Keyed ht(seed, kIdTokenScale);
  for (int64_t t = 0; t < N; ++t) token_scale[static_cast<size_t>(t)] = std::exp(0.5 * box_muller(ht(t)));

  const int num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_detail::parallel_for(N, num_threads, [&](int64_t begin, int64_t end) {
    fill_activation(in.q_c, seed, kIdQc, model.q_lora_rank, 1.0, token_scale, begin, end);
    fill_activation(in.kv, seed, kIdKv, kKvLoraRank, 1.0, token_scale, begin, end);
    fill_activation(in.k_pe, seed, kIdKpe, kRopeDims, 2.0, token_scale, begin, end);
    if (has_indexer) fill_activation(in.index_k, seed, kIdIndexK, kIndexHeadDim, 1.0, token_scale, begin, end);
  });

  in.weights.q_norm_w = make_weights(seed, kIdQNormW, model.q_lora_rank, 1.0, 0.25);
  in.weights.kv_norm_w = make_weights(seed, kIdKvNormW, kKvLoraRank, 1.0, 0.3);
  if (has_indexer) {
    in.weights.index_ln_w = make_weights(seed, kIdIndexLnW, kIndexHeadDim, 1.0, 0.2);
    in.weights.index_ln_b = make_weights(seed, kIdIndexLnB, kIndexHeadDim, 0.0, 0.05);
  }
  return in;
}

std::string NonFiniteReport::describe() const {
  if (total() == 0) return "all values finite";
  std::string s;
  auto add = [&](const char* name, int64_t n) {
    if (n == 0) return;
    if (!s.empty()) s += ", ";
    s += fmt::format("{}: {} non-finite value{}", name, n, n == 1 ? "" : "s");
  };
  add("q_c", q_c);
  add("kv", kv);
  add("k_pe", k_pe);
  add("index_k", index_k);
  add("weights", weights);
  return s;
}

NonFiniteReport count_nonfinite(const GlobalInputs& in) {
  NonFiniteReport r;
  auto count16 = [](const std::vector<uint16_t>& v) {
    return static_cast<int64_t>(std::count_if(v.begin(), v.end(), bf16_nonfinite));
  };
  auto count32 = [](const std::vector<float>& v) {
    return static_cast<int64_t>(std::count_if(v.begin(), v.end(), [](float f) { return !std::isfinite(f); }));
  };
  r.q_c = count16(in.q_c);
  r.kv = count16(in.kv);
  r.k_pe = count16(in.k_pe);
  r.index_k = count16(in.index_k);
  r.weights = count32(in.weights.q_norm_w) + count32(in.weights.kv_norm_w) + count32(in.weights.index_ln_w) +
              count32(in.weights.index_ln_b);
  return r;
}

void validate_inputs(const GlobalInputs& in, const ModelConfig& model, const PcpPlan& plan, bool has_indexer) {
  const int64_t N = plan.num_global_tokens();
  PCPKV_CHECK(in.num_tokens == N, "inputs: num_tokens = {} but the plan has {} new tokens", in.num_tokens, N);
  PCPKV_CHECK(in.q_lora_rank == model.q_lora_rank, "inputs: q_lora_rank = {} but model {} has q_lora_rank = {}",
              in.q_lora_rank, model.name, model.q_lora_rank);
  check_size(in.q_c, N, in.q_lora_rank, "q_c");
  check_size(in.kv, N, kKvLoraRank, "kv");
  check_size(in.k_pe, N, kRopeDims, "k_pe");
  check_size(in.positions, N, 1, "positions");
  for (int64_t t = 0; t < N; ++t)
    PCPKV_CHECK(in.positions[static_cast<size_t>(t)] == plan.global_positions[static_cast<size_t>(t)],
                "inputs: positions[{}] = {} but the plan places token {} at position {}",
                t, in.positions[static_cast<size_t>(t)], t, plan.global_positions[static_cast<size_t>(t)]);
  check_size(in.weights.q_norm_w, 1, in.q_lora_rank, "q_norm_w");
  check_size(in.weights.kv_norm_w, 1, kKvLoraRank, "kv_norm_w");
  if (has_indexer) {
    check_size(in.index_k, N, kIndexHeadDim, "index_k");
    check_size(in.weights.index_ln_w, 1, kIndexHeadDim, "index_ln_w");
    check_size(in.weights.index_ln_b, 1, kIndexHeadDim, "index_ln_b");
  }
}

RankInputs rank_inputs(const GlobalInputs& in, const PcpPlan& plan, int32_t rank) {
  RankInputs out;
  rank_inputs(in, plan, rank, &out);
  return out;
}

void rank_inputs(const GlobalInputs& in, const PcpPlan& plan, int32_t rank, RankInputs* out_ptr) {
  PCPKV_CHECK(out_ptr != nullptr, "rank_inputs: out is null");
  RankInputs& out = *out_ptr;
  PCPKV_CHECK(rank >= 0 && rank < plan.pcp_world, "rank_inputs: rank = {} is out of range [0, {})", rank,
              plan.pcp_world);
  PCPKV_CHECK(in.num_tokens == plan.num_global_tokens(), "rank_inputs: inputs have {} tokens, the plan {}",
              in.num_tokens, plan.num_global_tokens());
  const RankPlan& rp = plan.ranks[static_cast<size_t>(rank)];
  const int64_t M = plan.max_local_tokens;
  const bool has_index = !in.index_k.empty();
  out.num_tokens = M;
  out.positions = rp.positions;
  out.slot_mapping = rp.slot_mapping;
  out.q_c.resize(static_cast<size_t>(M * in.q_lora_rank));
  out.kv.resize(static_cast<size_t>(M * kKvLoraRank));
  out.k_pe.resize(static_cast<size_t>(M * kRopeDims));
  out.index_k.resize(has_index ? static_cast<size_t>(M * kIndexHeadDim) : 0);
  // Padding rows: seeded non-zero junk, the same for a given (rank, row), so runs are reproducible.
  const Keyed junk(0x6a756e6bull + static_cast<uint64_t>(rank), kIdJunk);
  auto copy = [&](std::vector<uint16_t>& dst, const std::vector<uint16_t>& src, int64_t width, int64_t i,
                  int64_t g, uint64_t tensor) {
    uint16_t* d = dst.data() + i * width;
    if (g >= 0) {
      std::copy_n(src.data() + g * width, width, d);
      return;
    }
    for (int64_t c = 0; c < width; ++c) {
      const double v = 4.0 * approx_normal(junk((tensor << 56) ^ static_cast<uint64_t>(i * width + c)));
      d[c] = to_bf16(v == 0.0 ? 0.5 : v);
    }
  };
  for (int64_t i = 0; i < M; ++i) {
    const int64_t g = rp.global_index[static_cast<size_t>(i)];
    copy(out.q_c, in.q_c, in.q_lora_rank, i, g, kIdQc);
    copy(out.kv, in.kv, kKvLoraRank, i, g, kIdKv);
    copy(out.k_pe, in.k_pe, kRopeDims, i, g, kIdKpe);
    if (has_index) copy(out.index_k, in.index_k, kIndexHeadDim, i, g, kIdIndexK);
  }
}

}  // namespace pcpkv
