// pcpkv-test-labels: cuda
// The replica check's kernels (pcpkv/publish/kernels.h launch_slot_hashes, launch_compare_replica_hashes) against
// their CPU oracles (pcpkv/publish/replica_hash.h) on the same bytes: seeded random caches of every format, with and
// without an indexer, dense and padded geometries, slots in any order (grid-stride over many); the comparison with
// diffs in some ranks; and DeviceReplicaCheck on a Publisher's W replicas after a direct publication (clean: no
// diffs, hashes equal to the CPU hashes of the downloaded replicas; one corrupted device byte: named like the CPU
// check names it). The indexer cache at its own slots (docs/spec.md 4.2, 5.2): launch_slot_hashes_own_index against
// its oracle (own block count, padded block stride, -1 in either mapping), its fixed values, and DeviceReplicaCheck
// over a plan with its own indexer blocks. Skips without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/cuda/buffers.h"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/replica_hash.h"
#include "publish/checks/cuda/device_replica_check.h"
#include "publish/drivers/cuda/publisher.h"
#include "support/gpu.h"
#include "support/publish_case.h"

namespace pcpkv {
namespace {

using cuda::DeviceBuffer;

struct Geometry {
  int32_t block_size;
  int64_t num_blocks, row_pad, block_pad, index_block_pad;
};

// Host bytes, their device copy, and the targets over both. index_blocks > 0: the indexer cache has its own block
// count (docs/spec.md 4.2), else the MLA cache's.
struct Replica {
  std::vector<uint8_t> mla, index;
  DeviceBuffer d_mla, d_index;
  CacheTarget host, dev;
  Replica(KvFormat f, const Geometry& g, uint64_t seed, int64_t index_blocks = 0) {
    host.mla.num_blocks = g.num_blocks;
    host.mla.block_size = g.block_size;
    host.mla.row_stride = mla_row_bytes(f) + g.row_pad;
    host.mla.block_stride = g.block_size * host.mla.row_stride + g.block_pad;
    host.index = dense_indexer_geometry(index_blocks > 0 ? index_blocks : g.num_blocks, g.block_size);
    host.index.block_stride += g.index_block_pad;
    mla.resize(static_cast<size_t>(host.mla.bytes()));
    index.resize(static_cast<size_t>(host.index.bytes()));
    std::mt19937_64 gen(seed);
    for (uint8_t& b : mla) b = static_cast<uint8_t>(gen());
    for (uint8_t& b : index) b = static_cast<uint8_t>(gen());
    d_mla = DeviceBuffer::from(mla);
    d_index = DeviceBuffer::from(index);
    host.mla_base = mla.data();
    host.index_base = index.data();
    dev = host;
    dev.mla_base = d_mla.data();
    dev.index_base = d_index.data();
  }
};

std::vector<uint64_t> gpu_hashes(const CacheTarget& t, const CacheFormat& fmt, const std::vector<int64_t>& slots) {
  DeviceBuffer d_slots = DeviceBuffer::from(slots);
  DeviceBuffer d_hashes(static_cast<int64_t>(slots.size() * 8));
  PCPKV_CUDA_CHECK(cudaMemset(d_hashes.data(), 0xA5, slots.size() * 8));  // poisoned: every entry must be written
  cuda::launch_slot_hashes(t, fmt, d_slots.as<const int64_t>(), static_cast<int64_t>(slots.size()),
                                  d_hashes.as<uint64_t>(), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d_hashes.download<uint64_t>(static_cast<int64_t>(slots.size()));
}

// The fp8_ds_mla replica of 2 blocks x 4 slots whose bytes come from the formula of
// tests/publish/test_replica_hash.cpp and python/tests/test_replica_check.py (their fixed values).
std::unique_ptr<Replica> pattern_replica() {
  auto p = std::make_unique<Replica>(KvFormat::kFp8DsMla, Geometry{4, 2, 0, 0, 0}, 0);
  for (int64_t s = 0; s < 8; ++s) {
    for (int64_t j = 0; j < 656; ++j) p->mla[p->host.mla.row_offset(s) + j] = static_cast<uint8_t>(s * 31 + j * 7 + 3);
    for (int64_t j = 0; j < 128; ++j)
      p->index[p->host.index.data_offset(s) + j] = static_cast<uint8_t>(s * 17 + j * 11 + 5);
    for (int64_t k = 0; k < 4; ++k)
      p->index[p->host.index.scale_offset(s) + k] = static_cast<uint8_t>(s * 13 + k * 29 + 1);
  }
  p->d_mla.upload(p->mla);
  p->d_index.upload(p->index);
  return p;
}

// A direct publication on the GPU, fenced, and its download.
PublishResult publish_direct(cuda::Publisher& pub, cuda::Stream& stream) {
  pub.enqueue(Transport::kDirect, stream.get());
  stream.sync();
  pub.check_fence();
  return pub.download(Transport::kDirect);
}

// Flips the bits `mask` of one device byte.
void flip_device_byte(uint8_t* p, uint8_t mask) {
  uint8_t b = 0;
  PCPKV_CUDA_CHECK(cudaMemcpy(&b, p, 1, cudaMemcpyDeviceToHost));
  b ^= mask;
  PCPKV_CUDA_CHECK(cudaMemcpy(p, &b, 1, cudaMemcpyHostToDevice));
}

// Replica q of a download as a host target (its allocation's bytes from the recorded offsets).
CacheTarget host_target(const PublishResult& host, int32_t q) {
  CacheTarget t;
  t.mla_base = const_cast<uint8_t*>(host.mla_alloc[q].data()) + host.mla_cache_offset;
  t.mla = host.mla_geometry;
  t.index_base = const_cast<uint8_t*>(host.index_alloc[q].data()) + host.index_cache_offset;
  t.index = host.index_geometry;
  return t;
}

TEST(ReplicaHashGpu, EqualsTheCpuOracleOnTheSameBytes) {
  REQUIRE_GPU();
  const Geometry geometries[] = {{64, 40, 0, 0, 0}, {16, 300, 16, 48, 16}, {4, 9, 32, 16, 0}};
  uint64_t seed = 1;
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16})
    for (const Geometry& g : geometries)
      for (bool indexer : {true, false}) {
        CacheFormat fmt;
        fmt.kv_format = f;
        fmt.has_indexer = indexer;
        Replica rep(f, g, ++seed);
        // Every slot once in a shuffled order, then a few repeated (the kernel does not need distinct slots).
        std::vector<int64_t> slots(static_cast<size_t>(g.num_blocks * g.block_size));
        std::iota(slots.begin(), slots.end(), 0);
        std::shuffle(slots.begin(), slots.end(), std::mt19937_64(seed));
        slots.insert(slots.end(), {0, slots.back(), 3});
        const std::vector<uint64_t> cpu = slot_hashes_reference(rep.host, fmt, slots);
        const std::vector<uint64_t> gpu = gpu_hashes(rep.dev, fmt, slots);
        ASSERT_EQ(gpu.size(), cpu.size());
        int64_t bad = 0, first = -1;
        for (size_t i = 0; i < cpu.size(); ++i)
          if (gpu[i] != cpu[i] && bad++ == 0) first = static_cast<int64_t>(i);
        EXPECT_EQ(bad, 0) << to_string(f) << " block " << g.block_size << " row pad " << g.row_pad << " indexer "
                          << indexer << ": first at " << first << " (slot " << (first >= 0 ? slots[first] : -1)
                          << ")";
      }
}

TEST(ReplicaHashGpu, ManySlotsAndTheFixedValues) {
  REQUIRE_GPU();
  // 200000 slots: the grid strides (more warps of work than the grid holds).
  const Geometry g{64, 3125, 0, 0, 0};
  CacheFormat fmt;
  fmt.kv_format = KvFormat::kFp8DsMla;
  fmt.has_indexer = true;
  Replica rep(KvFormat::kFp8DsMla, g, 99);
  std::vector<int64_t> slots(200000);
  std::iota(slots.begin(), slots.end(), 0);
  EXPECT_EQ(gpu_hashes(rep.dev, fmt, slots), slot_hashes_reference(rep.host, fmt, slots));
  // The pattern of tests/publish/test_replica_hash.cpp and python/tests/test_replica_check.py, on the GPU.
  const std::unique_ptr<Replica> p = pattern_replica();
  EXPECT_EQ(gpu_hashes(p->dev, fmt, {5, 2, 7}),
            (std::vector<uint64_t>{0x410BA49A32B1B98Eull, 0x5BC997F4B7878A5Eull, 0x971960CA7DEF46AEull}));
}

TEST(ReplicaHashGpu, CompareEqualsItsOracle) {
  REQUIRE_GPU();
  const int32_t W = 5;
  const int64_t n = 70000;
  std::vector<std::vector<uint64_t>> h(W, std::vector<uint64_t>(n));
  std::mt19937_64 gen(7);
  for (int64_t i = 0; i < n; ++i) h[0][i] = gen();
  for (int32_t q = 1; q < W; ++q) h[q] = h[0];
  h[2][65000] ^= 1;
  h[4][12] += 1;
  h[4][69999] += 1;
  h[4][40000] += 1;
  std::vector<uint64_t> flat;
  for (const auto& v : h) flat.insert(flat.end(), v.begin(), v.end());
  DeviceBuffer d_h = DeviceBuffer::from(flat);
  DeviceBuffer d_diffs(W * static_cast<int64_t>(sizeof(cuda::DeviceHashDiff)));
  PCPKV_CUDA_CHECK(cudaMemset(d_diffs.data(), 0x5A, static_cast<size_t>(d_diffs.bytes())));  // the launcher initializes
  cuda::launch_compare_replica_hashes(d_h.as<const uint64_t>(), W, n, d_diffs.as<cuda::DeviceHashDiff>(),
                                             nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = d_diffs.download<cuda::DeviceHashDiff>(W);
  const std::vector<ReplicaHashDiff> want = compare_replica_hashes_reference(h);
  for (int32_t q = 0; q < W; ++q) {
    EXPECT_EQ(static_cast<int64_t>(got[q].num_diff), want[q].num_diff) << q;
    EXPECT_EQ(got[q].num_diff == 0 ? -1 : static_cast<int64_t>(got[q].first), want[q].first) << q;
  }
  EXPECT_EQ(want[4].num_diff, 3);
  EXPECT_EQ(want[4].first, 12);
}

TEST(ReplicaHashGpu, DeviceReplicaCheckOnAPublishersReplicas) {
  REQUIRE_GPU();
  test::CaseSpec spec;
  spec.pcp = 4;
  spec.requests = {{RequestKind::kPrefill, 203, 0}, {RequestKind::kDecode, 1, 40}};
  spec.alloc.base_offset = 48;
  auto c = test::make_case(spec);
  cuda::Publisher pub(c->setup, c->inputs);
  cuda::Stream stream;
  const PublishResult host = publish_direct(pub, stream);
  const std::vector<int64_t> slots = written_slots(c->plan);
  cuda::DeviceReplicaCheck check(pub.targets(), c->setup.fmt, slots);
  check.enqueue(stream.get());
  stream.sync();
  const Check clean = replica_hash_check(check.diffs(), slots, check.bytes_per_slot(), {0, "direct", ""});
  EXPECT_TRUE(clean.pass) << clean.detail;
  EXPECT_EQ(check.cache_bytes_read(), 4 * static_cast<int64_t>(slots.size()) * (656 + 132));
  // The GPU's hashes of every replica are the CPU's hashes of its downloaded bytes.
  for (int32_t q = 0; q < 4; ++q)
    EXPECT_EQ(check.hashes(q), slot_hashes_reference(host_target(host, q), c->setup.fmt, slots)) << "rank " << q;
  // One device byte of rank 3's indexer scale of the 10th written slot: named like the CPU check names it.
  const int64_t slot = slots[10];
  flip_device_byte(pub.targets()[3].index_base + pub.targets()[3].index.scale_offset(slot) + 2, 0x80);
  check.enqueue(stream.get());
  stream.sync();
  const Check bad = replica_hash_check(check.diffs(), slots, check.bytes_per_slot(), {0, "direct", ""});
  EXPECT_FALSE(bad.pass);
  EXPECT_NE(bad.detail.find(fmt::format("layer 0 (direct): rank 3 differs from rank 0 at slot {} (", slot)),
            std::string::npos)
      << bad.detail;
  EXPECT_EQ(bad.num_diff, 1);
}

std::vector<uint64_t> gpu_own_hashes(const CacheTarget& t, const CacheFormat& fmt, const std::vector<int64_t>& slots,
                                     const std::vector<int64_t>& index_slots) {
  DeviceBuffer d_slots = DeviceBuffer::from(slots);
  DeviceBuffer d_index_slots = DeviceBuffer::from(index_slots);
  DeviceBuffer d_hashes(static_cast<int64_t>(slots.size() * 8));
  PCPKV_CUDA_CHECK(cudaMemset(d_hashes.data(), 0xA5, slots.size() * 8));  // poisoned: every entry must be written
  cuda::launch_slot_hashes_own_index(t, fmt, d_slots.as<const int64_t>(), d_index_slots.as<const int64_t>(),
                                     static_cast<int64_t>(slots.size()), d_hashes.as<uint64_t>(), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d_hashes.download<uint64_t>(static_cast<int64_t>(slots.size()));
}

TEST(ReplicaHashGpu, OwnIndexerSlotsEqualTheCpuOracle) {
  REQUIRE_GPU();
  uint64_t seed = 50;
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16})
    for (bool indexer : {true, false}) {
      CacheFormat fmt;
      fmt.kv_format = f;
      fmt.has_indexer = indexer;
      Replica rep(f, {16, 300, 16, 48, 48}, ++seed, 347);
      // Every MLA slot once, shuffled; each entry an indexer slot of a shuffled subset; -1 in either now and then.
      std::mt19937_64 gen(seed);
      std::vector<int64_t> slots(300 * 16), islots(347 * 16);
      std::iota(slots.begin(), slots.end(), 0);
      std::iota(islots.begin(), islots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), gen);
      std::shuffle(islots.begin(), islots.end(), gen);
      islots.resize(slots.size());
      for (size_t i = 0; i < slots.size(); i += 37) slots[i] = -1;
      for (size_t i = 5; i < slots.size(); i += 41) islots[i] = -1;
      const std::vector<uint64_t> cpu = slot_hashes_reference(rep.host, fmt, slots, islots);
      EXPECT_EQ(gpu_own_hashes(rep.dev, fmt, slots, islots), cpu) << to_string(f) << " indexer " << indexer;
      // index_slots == slots: the one-slot kernel's hashes bit for bit.
      std::vector<int64_t> same(slots);
      for (int64_t& s : same) s = s < 0 ? 0 : s;
      EXPECT_EQ(gpu_own_hashes(rep.dev, fmt, same, same), gpu_hashes(rep.dev, fmt, same)) << to_string(f);
    }
  // The fixed values of tests/publish/test_replica_hash_own_index.cpp.
  const std::unique_ptr<Replica> p = pattern_replica();
  CacheFormat fmt;
  fmt.kv_format = KvFormat::kFp8DsMla;
  fmt.has_indexer = true;
  EXPECT_EQ(gpu_own_hashes(p->dev, fmt, {5, -1, 7}, {1, 6, -1}),
            (std::vector<uint64_t>{0x79A4A14DD736F196ull, 0x8AB02EB017E51108ull, 0xB0752CA762797EE8ull}));
}

TEST(ReplicaHashGpu, DeviceReplicaCheckWithOwnIndexerBlocks) {
  REQUIRE_GPU();
  test::CaseSpec spec;
  spec.pcp = 4;
  spec.block_size = 8;
  spec.requests = {{RequestKind::kPrefill, 203, 0}, {RequestKind::kDecode, 1, 40}};
  spec.alloc.index_block_pad = 48;
  spec.own_index_blocks = true;
  spec.index_extra_blocks = 3;
  auto c = test::make_case(spec);
  ASSERT_TRUE(c->plan.has_index_slots());
  cuda::Publisher pub(c->setup, c->inputs);
  cuda::Stream stream;
  const PublishResult host = publish_direct(pub, stream);
  const std::vector<int64_t> slots = written_slots(c->plan), islots = written_index_slots(c->plan);
  cuda::DeviceReplicaCheck check(pub.targets(), c->setup.fmt, slots, islots);
  check.enqueue(stream.get());
  stream.sync();
  const Check clean =
      replica_hash_check(check.diffs(), slots, check.bytes_per_slot(), {0, "direct", ""}, {}, check.index_slots());
  EXPECT_TRUE(clean.pass) << clean.detail;
  for (int32_t q = 0; q < 4; ++q)
    EXPECT_EQ(check.hashes(q), slot_hashes_reference(host_target(host, q), c->setup.fmt, slots, islots))
        << "rank " << q;
  // One device byte of rank 3's indexer data at an entry's own indexer slot: named with both slots.
  size_t i = 10;
  while (islots[i] == slots[i]) ++i;
  flip_device_byte(pub.targets()[3].index_base + pub.targets()[3].index.data_offset(islots[i]) + 100, 0x80);
  check.enqueue(stream.get());
  stream.sync();
  const Check bad =
      replica_hash_check(check.diffs(), slots, check.bytes_per_slot(), {0, "direct", ""}, {}, check.index_slots());
  EXPECT_FALSE(bad.pass);
  EXPECT_EQ(bad.num_diff, 1);
  EXPECT_NE(bad.detail.find(fmt::format("layer 0 (direct): rank 3 differs from rank 0 at slot {} (indexer slot {}) (",
                                        slots[i], islots[i])),
            std::string::npos)
      << bad.detail;
}

TEST(ReplicaHashGpu, BadParametersAreRefusedBeforeALaunch) {
  REQUIRE_GPU();
  Replica rep(KvFormat::kFp8DsMla, {16, 4, 0, 0, 0}, 3);
  CacheFormat fmt;
  fmt.kv_format = KvFormat::kFp8DsMla;
  fmt.has_indexer = true;
  EXPECT_THROW(cuda::launch_slot_hashes(rep.dev, fmt, nullptr, 4, nullptr, nullptr), Error);
  CacheTarget no_index = rep.dev;
  no_index.index_base = nullptr;
  DeviceBuffer s(64), h(64);
  EXPECT_THROW(cuda::launch_slot_hashes(no_index, fmt, s.as<const int64_t>(), 1, h.as<uint64_t>(), nullptr),
               Error);
  EXPECT_THROW(cuda::launch_compare_replica_hashes(nullptr, 0, 1, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::DeviceReplicaCheck({rep.dev}, fmt, {0, 64}), Error) << "slot 64 of a 64-slot cache";
  EXPECT_THROW(cuda::launch_slot_hashes_own_index(rep.dev, fmt, s.as<const int64_t>(), nullptr, 1, h.as<uint64_t>(),
                                                  nullptr),
               Error)
      << "no index_slots";
  EXPECT_THROW(cuda::DeviceReplicaCheck({rep.dev}, fmt, {0, 1}, {3, 64}), Error) << "indexer slot 64 of 64";
  EXPECT_THROW(cuda::DeviceReplicaCheck({rep.dev}, fmt, {0, 1}, {3}), Error) << "one indexer slot for two";
}

}  // namespace
}  // namespace pcpkv
