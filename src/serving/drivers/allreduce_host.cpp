// src/serving/drivers/allreduce_host.cpp: the all-reduce protocol on the CPU (pcpkv/serving/allreduce.h): ranks are
// threads or processes sharing host memory. Same workspace layout, per-block barriers with epochs and parities, and
// work split as the CUDA kernel, so CI exercises the protocol that the GPU runs.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "pcpkv/serving/allreduce.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/device/fp32.h"
#include "pcpkv/device/token_math.h"
#include "pcpkv/core/error.h"

namespace pcpkv {
namespace {

uint32_t* u32_at(uint8_t* base, int64_t offset) { return reinterpret_cast<uint32_t*>(base + offset); }

struct Run {
  const HostAllReduceArgs& a;
  AllReducePartition part;
  bool two_shot = false;
  uint8_t* mine = nullptr;

  uint16_t* data(int32_t r, uint32_t parity) const {
    return reinterpret_cast<uint16_t*>(a.workspaces[r] + a.layout.data_offset(parity));
  }
  uint16_t* aux(int32_t r, uint32_t parity) const {
    return reinterpret_cast<uint16_t*>(a.workspaces[r] + a.layout.aux_offset(parity));
  }
  int64_t item_elems() const { return a.fused ? a.norm.hidden : 8; }

  /// Calls f(item) for every item of block blk in segment q.
  template <typename F>
  void for_items(int32_t blk, int32_t q, F&& f) const {
    const int64_t begin = part.segment_begin(q), end = part.segment_end(q);
    for (int64_t c = blk; c < part.num_chunks(q); c += part.num_blocks) {
      const int64_t i0 = begin + c * part.items_per_chunk;
      const int64_t i1 = std::min(end, i0 + part.items_per_chunk);
      for (int64_t i = i0; i < i1; ++i) f(i);
    }
  }

  void barrier(int32_t blk, int barrier_idx, uint32_t epoch) const {
    const uint32_t parity = epoch & 1u;
    for (int32_t q = 0; q < a.world_size; ++q)
      std::atomic_ref<uint32_t>(*u32_at(a.workspaces[q], AllReduceLayout::signal_offset(blk, barrier_idx, parity, a.rank)))
          .store(epoch, std::memory_order_release);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(a.timeout_ms);
    for (int32_t q = 0; q < a.world_size; ++q) {
      std::atomic_ref<uint32_t> slot(*u32_at(mine, AllReduceLayout::signal_offset(blk, barrier_idx, parity, q)));
      for (uint64_t spins = 0; slot.load(std::memory_order_acquire) != epoch; ++spins) {
        if ((spins & 63) == 63 && std::chrono::steady_clock::now() > deadline) {
          std::atomic_ref<uint32_t>(*u32_at(mine, AllReduceLayout::kErrorOffset))
              .store(static_cast<uint32_t>(q + 1), std::memory_order_relaxed);
          throw FenceTimeout(fmt::format("all-reduce: rank {} waited {} ms at block {} barrier {} (epoch {}) and rank "
                                         "{} never arrived",
                                         a.rank, a.timeout_ms, blk, barrier_idx, epoch, q),
                             q, fmt::format("{}:{}", __FILE__, __LINE__));
        }
        std::this_thread::yield();
      }
    }
  }

  /// Reduces item i from every rank's data region into fp32-exact bf16 values (rank order).
  void reduce_item(int64_t i, uint32_t parity, uint16_t* dst) const {
    const int64_t n = item_elems();
    for (int64_t k = 0; k < n; ++k) {
      float acc = codec::bf16_to_float(data(0, parity)[i * n + k]);
      for (int32_t r = 1; r < a.world_size; ++r) acc = fp32::add(acc, codec::bf16_to_float(data(r, parity)[i * n + k]));
      dst[k] = codec::float_to_bf16(acc);
    }
  }

  /// Fused row i: residual add and RMSNorm of the reduced row `reduced` -> residual_row, y_row.
  void norm_row(int64_t i, const uint16_t* reduced, uint16_t* residual_row, uint16_t* y_row) const {
    const int64_t H = a.norm.hidden;
    std::vector<float> r(static_cast<size_t>(H));
    std::vector<float> leaves(1024);
    for (int64_t k = 0; k < H; ++k) {
      const uint16_t res = codec::float_to_bf16(
          fp32::add(codec::bf16_to_float(reduced[k]), codec::bf16_to_float(a.residual_in[i * H + k])));
      residual_row[k] = res;
      r[k] = codec::bf16_to_float(res);
    }
    const int m = static_cast<int>(H / math::kLeaf);
    for (int j = 0; j < m; ++j) leaves[j] = math::leaf_sumsq(r.data() + j * math::kLeaf);
    const float inv = math::rms_inv(math::pairwise_sum(leaves.data(), m), static_cast<int>(H), a.norm.eps);
    for (int64_t k = 0; k < H; ++k) y_row[k] = codec::float_to_bf16(math::rms_apply(r[k], inv, a.norm.weight[k]));
  }

  void block(int32_t blk, uint32_t epoch) const {
    const uint32_t parity = epoch & 1u;
    const int64_t n = item_elems();
    for (int32_t q = 0; q < part.num_segments; ++q)
      for_items(blk, q, [&](int64_t i) { std::memcpy(data(a.rank, parity) + i * n, a.in + i * n, n * 2); });
    barrier(blk, 0, epoch);
    std::vector<uint16_t> reduced(static_cast<size_t>(n));
    const int32_t own = two_shot ? a.rank : 0;
    for_items(blk, own, [&](int64_t i) {
      reduce_item(i, parity, reduced.data());
      if (a.fused) {
        uint16_t* res_row = a.residual_out + i * n;
        uint16_t* y_row = a.out + i * n;
        norm_row(i, reduced.data(), res_row, y_row);
        if (two_shot) {  // owner's results become the all-gather source (its own input rows are done)
          std::memcpy(data(a.rank, parity) + i * n, y_row, n * 2);
          std::memcpy(aux(a.rank, parity) + i * n, res_row, n * 2);
        }
      } else {
        std::memcpy(a.out + i * n, reduced.data(), n * 2);
        if (two_shot) std::memcpy(data(a.rank, parity) + i * n, reduced.data(), n * 2);
      }
    });
    if (!two_shot) return;
    barrier(blk, 1, epoch);
    for (int32_t q = 0; q < a.world_size; ++q) {
      if (q == a.rank) continue;
      for_items(blk, q, [&](int64_t i) {
        std::memcpy(a.out + i * n, data(q, parity) + i * n, n * 2);
        if (a.fused) std::memcpy(a.residual_out + i * n, aux(q, parity) + i * n, n * 2);
      });
    }
  }
};

}  // namespace

void host_allreduce(const HostAllReduceArgs& a) {
  validate_allreduce(a.world_size, a.rank, a.layout, a.num_elems, a.fused, a.norm);
  for (int32_t r = 0; r < a.world_size; ++r)
    PCPKV_CHECK(a.workspaces[r] != nullptr, "all-reduce: rank {} has no address for rank {}'s workspace", a.rank, r);
  PCPKV_CHECK(a.timeout_ms > 0, "all-reduce: timeout_ms = {} must be > 0", a.timeout_ms);
  if (a.num_elems > 0) {
    PCPKV_CHECK(a.in != nullptr && a.out != nullptr, "all-reduce: null in or out pointer");
    PCPKV_CHECK(!a.fused || (a.residual_in != nullptr && a.residual_out != nullptr),
                "all-reduce: the fused variant needs residual_in and residual_out");
  }
  Run run{a, {}, false, a.workspaces[a.rank]};
  const AllReduceAlgo algo =
      a.algo == AllReduceAlgo::kAuto ? choose_allreduce_algo(a.num_elems * 2, a.world_size, a.fused) : a.algo;
  run.two_shot = algo == AllReduceAlgo::kTwoShot;
  run.part.num_items = a.fused ? a.num_elems / a.norm.hidden : a.num_elems / 8;
  run.part.items_per_chunk = a.fused ? 1 : kAllReduceChunkVectors;
  run.part.num_segments = run.two_shot ? a.world_size : 1;
  run.part.num_blocks = a.num_blocks > 0 ? a.num_blocks : allreduce_num_blocks(run.part, 4);
  PCPKV_CHECK(run.part.num_blocks >= 1 && run.part.num_blocks <= kAllReduceMaxBlocks,
              "all-reduce: num_blocks = {} is outside [1, {}]", run.part.num_blocks, kAllReduceMaxBlocks);
  if (a.num_elems == 0) return;  // every rank skips the call alike: epochs stay in step
  uint32_t* epoch_slot = u32_at(run.mine, AllReduceLayout::kEpochOffset);
  const uint32_t epoch = *epoch_slot + 1;
  for (int32_t blk = 0; blk < run.part.num_blocks; ++blk) run.block(blk, epoch);
  *epoch_slot = epoch;
}

}  // namespace pcpkv
