// Seeded queries and cache rows of the end-to-end consumer check, and the CPU consumers object.
#include <cmath>
#include <cstring>

#include "consumers/checks/attention_check_internal.h"
#include "pcpkv/consumers/attention_check.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"

namespace pcpkv {

namespace attention_inputs {

uint64_t Rng::next() {
  // splitmix64: tiny, portable, the same stream on every platform (std distributions are not).
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
double Rng::uniform() { return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
double Rng::normal() {
  const double u1 = uniform(), u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

namespace {
/// Channels 10x-30x larger than the rest, fixed per tensor kind (LLM activations have a few such).
bool is_outlier(int d, int salt) { return ((d * 37 + salt * 11) % 97) == 0; }
}  // namespace

void random_row(Rng& rng, float* x, int n, double sigma, int salt) {
  const double tok = std::exp(0.5 * rng.normal());  // per-row magnitude, log-normal
  for (int d = 0; d < n; ++d) {
    double v = rng.normal() * sigma * tok;
    if (is_outlier(d, salt)) v *= 10.0 + 20.0 * rng.uniform();
    x[d] = static_cast<float>(v);
  }
}

void encode_mla_row(const float* kv_c, const float* k_pe, const CacheFormat& fmt, uint8_t* row) {
  auto put_bf16 = [](uint8_t* p, float v) {
    const uint16_t b = codec::float_to_bf16(v);
    p[0] = static_cast<uint8_t>(b & 0xff);
    p[1] = static_cast<uint8_t>(b >> 8);
  };
  switch (fmt.kv_format) {
    case KvFormat::kBf16:
      for (int d = 0; d < 512; ++d) put_bf16(row + 2 * d, kv_c[d]);
      for (int d = 0; d < 64; ++d) put_bf16(row + 1024 + 2 * d, k_pe[d]);
      break;
    case KvFormat::kFp8:
      for (int d = 0; d < 512; ++d) row[d] = codec::quantize_e4m3(kv_c[d], fmt.k_scale);
      for (int d = 0; d < 64; ++d) row[512 + d] = codec::quantize_e4m3(k_pe[d], fmt.k_scale);
      break;
    case KvFormat::kFp8DsMla:
      for (int tile = 0; tile < 4; ++tile) {
        float amax = 0.0f;
        for (int d = 0; d < 128; ++d) amax = fp32::amax(amax, fp32::abs(kv_c[128 * tile + d]));
        const float s = codec::ds_mla_tile_scale(amax, fmt.ds_mla_scale == DsMlaScale::kPow2);
        for (int d = 0; d < 128; ++d) row[128 * tile + d] = codec::quantize_e4m3(kv_c[128 * tile + d], s);
        std::memcpy(row + kDsMlaScaleOffset + 4 * tile, &s, 4);  // little-endian hosts only (x86, arm64)
      }
      for (int d = 0; d < 64; ++d) put_bf16(row + kDsMlaKpeOffset + 2 * d, k_pe[d]);
      break;
  }
}

void encode_index_row(const float* k, uint8_t* data, uint8_t* scale) {
  float amax = 0.0f;
  for (int d = 0; d < 128; ++d) amax = fp32::amax(amax, fp32::abs(k[d]));
  const float s = codec::indexer_scale(amax);
  for (int d = 0; d < 128; ++d) data[d] = codec::quantize_e4m3(k[d], s);
  std::memcpy(scale, &s, 4);
}

}  // namespace attention_inputs

ConsumerQueries generate_queries(int64_t num_tokens, int32_t index_heads, int32_t heads, uint64_t seed) {
  PCPKV_CHECK(num_tokens >= 0, "generate_queries: num_tokens must be >= 0, got {}", num_tokens);
  PCPKV_CHECK(index_heads >= 1 && heads >= 1, "generate_queries: heads must be >= 1, got index {} / mla {}",
              index_heads, heads);
  ConsumerQueries q;
  q.num_tokens = num_tokens;
  q.index_heads = index_heads;
  q.heads = heads;
  attention_inputs::Rng rng{seed * 0x2545f4914f6cdd1dull + 0x51ed};
  const int64_t ni = num_tokens * index_heads;
  std::vector<uint16_t> iq(static_cast<size_t>(ni) * 128);
  float row[576];
  for (int64_t r = 0; r < ni; ++r) {
    attention_inputs::random_row(rng, row, 128, 1.0, 1);
    for (int d = 0; d < 128; ++d) iq[r * 128 + d] = codec::float_to_bf16(row[d]);
  }
  q.index_q_fp8.resize(iq.size());
  q.index_q_scale.resize(static_cast<size_t>(ni));
  quantize_index_queries(iq.data(), num_tokens, index_heads, q.index_q_fp8.data(), q.index_q_scale.data());
  q.index_weights.resize(static_cast<size_t>(ni));
  for (int64_t r = 0; r < ni; ++r) {
    double w = rng.normal();
    if (rng.uniform() < 0.02) w *= 25.0;  // a few dominant heads
    q.index_weights[r] = static_cast<float>(w);
  }
  const int64_t nq = num_tokens * heads;
  q.q.resize(static_cast<size_t>(nq) * 576);
  for (int64_t r = 0; r < nq; ++r) {
    attention_inputs::random_row(rng, row, 576, 0.5, 2);
    for (int d = 0; d < 576; ++d) q.q[r * 576 + d] = codec::float_to_bf16(row[d]);
  }
  return q;
}

// ---- CPU consumers --------------------------------------------------------------------------------
namespace {
class CpuConsumers final : public ConsumerKernels {
 public:
  std::string name() const override { return "cpu"; }
  void indexer(const IndexerParams& p) override { indexer_reference(p); }
  void sparse_mla(const SparseMlaParams& p) override { sparse_mla_reference(p); }
  void lse_merge(const LseMergeParams& p) override { lse_merge_reference(p); }
};
}  // namespace

std::unique_ptr<ConsumerKernels> make_cpu_consumers() { return std::make_unique<CpuConsumers>(); }

}  // namespace pcpkv
