// Host cost of validate_dispatch_shape: 8 jobs of 4096 tokens, 8 targets each (direct at PCP 8 on one GPU).
#include <chrono>
#include <cstdio>
#include <vector>
#include "pcpkv/publish/cpu.h"
#include "pcpkv/core/layout.h"
using namespace pcpkv;
int main() {
  const int64_t T = 4096, blocks = 1024; const int32_t bs = 64;
  auto at = [](uint64_t gb) { return reinterpret_cast<uint8_t*>(uintptr_t{0x100000000000ull} + (gb << 30)); };
  std::vector<CacheTarget> tg(8);
  for (int d = 0; d < 8; ++d) {
    tg[d].mla_base = at(4 * d); tg[d].mla = dense_mla_geometry(KvFormat::kFp8DsMla, blocks, bs);
    tg[d].index_base = at(4 * d + 2); tg[d].index.num_blocks = blocks; tg[d].index.block_size = bs;
    tg[d].index.block_stride = int64_t{bs} * (kIndexHeadDim + 4);
  }
  DispatchParams p;
  p.num_tokens = T; p.q_lora_rank = 2048;
  p.fmt.kv_format = KvFormat::kFp8DsMla; p.fmt.has_indexer = true;
  p.q_c = reinterpret_cast<const uint16_t*>(at(100)); p.q_c_stride = 2048;
  p.kv = reinterpret_cast<const uint16_t*>(at(101)); p.kv_stride = 512;
  p.k_pe = reinterpret_cast<const uint16_t*>(at(102)); p.k_pe_stride = 64;
  p.index_k = reinterpret_cast<const uint16_t*>(at(103)); p.index_k_stride = 128;
  p.positions = reinterpret_cast<const int64_t*>(at(104)); p.slot_mapping = reinterpret_cast<const int64_t*>(at(105));
  p.q_norm_w = reinterpret_cast<const float*>(at(106)); p.kv_norm_w = reinterpret_cast<const float*>(at(107));
  p.index_ln_w = reinterpret_cast<const float*>(at(108)); p.index_ln_b = reinterpret_cast<const float*>(at(109));
  p.rope_cos_sin = reinterpret_cast<const float*>(at(110)); p.rope_num_positions = 163840;
  p.q_c_out = reinterpret_cast<uint16_t*>(at(111));
  p.topk_fill = reinterpret_cast<int32_t*>(at(112)); p.topk_width = 2048;
  p.targets = tg.data(); p.num_targets = 8;
  try { validate_dispatch_shape(p); } catch (const std::exception& e) { std::printf("invalid: %s\n", e.what()); return 1; }
  for (int rep = 0; rep < 3; ++rep) {
    const int n = 20000;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) validate_dispatch_shape(p);
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
    std::printf("validate_dispatch_shape, 8 targets: %.3f us per call (x8 jobs: %.2f us)\n", us, 8 * us);
  }
}
