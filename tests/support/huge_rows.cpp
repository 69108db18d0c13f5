#include "support/huge_rows.h"

#include <cmath>

#include "pcpkv/device/codec.h"
#include "support/random_bf16.h"

namespace pcpkv::test {
namespace {

constexpr uint16_t kBf16Max = 0x7f7f;  // (2 - 2^-7) * 2^127

uint16_t with_sign(uint16_t magnitude, bool negative) { return negative ? magnitude | 0x8000u : magnitude; }
uint16_t pow2_bf16(int e) { return codec::float_to_bf16(std::ldexp(1.0f, e)); }

void fill_row(uint16_t* row, int64_t n, int kind, uint64_t seed) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = hash64(seed, static_cast<uint64_t>(i));
    const bool neg = h & 1;
    switch (kind) {
      case 0: break;  // the ordinary values stay; one element below
      case 1: row[i] = with_sign(kBf16Max, neg); break;
      case 2: row[i] = with_sign(kBf16Max, i >= n / 2); break;
      case 3: row[i] = with_sign(static_cast<uint16_t>(pow2_bf16(61) | ((h >> 8) & 0x7f)), neg); break;
      case 4: row[i] = with_sign(pow2_bf16(-40 + static_cast<int>((h >> 8) % 161)), neg); break;
      default: row[i] = with_sign(static_cast<uint16_t>(pow2_bf16(56) | ((h >> 8) & 0x7f)), neg); break;
    }
  }
  if (kind == 0) row[hash64(seed, 999) % static_cast<uint64_t>(n)] = with_sign(pow2_bf16(100), seed & 1);
}

}  // namespace

std::vector<int64_t> make_rows_huge(GlobalInputs& in, int64_t first, int64_t every, uint64_t seed) {
  std::vector<int64_t> tokens;
  for (int64_t t = first, i = 0; t < in.num_tokens; t += every, ++i) {
    const int kind = static_cast<int>(i % kHugeRowKinds);
    const uint64_t s = hash64(seed, static_cast<uint64_t>(t));
    fill_row(in.kv.data() + t * 512, 512, kind, s);
    if (!in.q_c.empty()) fill_row(in.q_c.data() + t * in.q_lora_rank, in.q_lora_rank, kind, s ^ 0x9u);
    if (!in.index_k.empty()) fill_row(in.index_k.data() + t * 128, 128, kind, s ^ 0x17u);
    tokens.push_back(t);
  }
  return tokens;
}

}  // namespace pcpkv::test
