// pcpkv-test-labels: unit
// The all-reduce (pcpkv/serving/allreduce.h, SPEC section 7) on the CPU: the oracle against independent math, and
// the protocol (ranks as threads over shared host memory, same barriers/epochs/work split as the GPU)
// against the oracle byte for byte, over world sizes, algorithms, block counts and consecutive calls.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/serving/allreduce.h"
#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "support/error_of.h"
#include "support/random_bf16.h"

namespace pcpkv {
namespace {

constexpr uint16_t kPoison = 0xA5A5;

using test::error_of;

/// W ranks' workspaces in one host allocation each, header zeroed (as setup must leave it).
struct HostWorld {
  AllReduceLayout layout;
  std::vector<std::vector<uint8_t>> ws;
  HostWorld(int32_t world, int64_t max_elems) {
    layout.max_elems = max_elems;
    for (int32_t r = 0; r < world; ++r) ws.emplace_back(static_cast<size_t>(layout.bytes()), 0x5A);
    for (auto& w : ws) std::memset(w.data(), 0, AllReduceLayout::kHeaderBytes);
  }
  HostAllReduceArgs args(int32_t rank) {
    HostAllReduceArgs a;
    a.world_size = static_cast<int32_t>(ws.size());
    a.rank = rank;
    for (size_t r = 0; r < ws.size(); ++r) a.workspaces[r] = ws[r].data();
    a.layout = layout;
    return a;
  }
};

/// Runs one call on every rank (one thread each); rethrows the first rank's error.
void run_threads(int32_t world, const std::function<void(int32_t)>& body) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  for (int32_t r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int32_t r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
}

TEST(AllReduce, OracleSumsInRankOrderWithOneRounding) {
  // Independent model: the fp32 sum in rank order (float arithmetic, no contraction), one bf16 rounding
  // done in double by hand (round to nearest even at 8 significant bits).
  const int32_t W = 5;
  const int64_t n = 4096;
  std::vector<std::vector<uint16_t>> in;
  std::vector<const uint16_t*> ptrs;
  for (int32_t r = 0; r < W; ++r) in.push_back(test::random_bf16(1, n, 100 + r));
  for (auto& v : in) ptrs.push_back(v.data());
  std::vector<uint16_t> out(n, kPoison);
  allreduce_reference(ptrs, n, out.data());
  for (int64_t i = 0; i < n; ++i) {
    volatile float acc = codec::bf16_to_float(in[0][i]);
    for (int32_t r = 1; r < W; ++r) acc = acc + codec::bf16_to_float(in[r][i]);
    int e = 0;
    const double m = std::frexp(static_cast<double>(acc), &e);  // acc = m * 2^e, 0.5 <= |m| < 1
    const double scaled = std::ldexp(m, 8);                     // 8 significant bits
    double rounded = std::nearbyint(scaled);                    // ties to even (default rounding mode)
    const float expect = static_cast<float>(std::ldexp(rounded, e - 8));
    ASSERT_EQ(codec::bf16_to_float(out[i]), expect) << i;
  }
}

TEST(AllReduce, FusedOracleMatchesFp64RmsNormWithinBf16Rounding) {
  const int32_t W = 3;
  const int64_t T = 4, H = 6144;
  std::vector<std::vector<uint16_t>> in;
  std::vector<const uint16_t*> ptrs;
  for (int32_t r = 0; r < W; ++r) in.push_back(test::random_bf16(T, H, 200 + r));
  for (auto& v : in) ptrs.push_back(v.data());
  const std::vector<uint16_t> residual = test::random_bf16(T, H, 300);
  const std::vector<float> w = test::random_weights(H, 301);
  AllReduceNorm norm{H, w.data(), 1e-5f};
  std::vector<uint16_t> res_out(T * H, kPoison), y(T * H, kPoison), reduced(T * H);
  allreduce_rmsnorm_reference(ptrs, T, norm, residual.data(), res_out.data(), y.data());
  allreduce_reference(ptrs, T * H, reduced.data());
  for (int64_t t = 0; t < T; ++t) {
    double sumsq = 0;
    for (int64_t k = 0; k < H; ++k) {
      const int64_t i = t * H + k;
      ASSERT_EQ(res_out[i], codec::float_to_bf16(codec::bf16_to_float(reduced[i]) + codec::bf16_to_float(residual[i])));
      const double v = codec::bf16_to_float(res_out[i]);
      sumsq += v * v;
    }
    const double inv = 1.0 / std::sqrt(sumsq / H + 1e-5);
    for (int64_t k = 0; k < H; ++k) {
      const int64_t i = t * H + k;
      const double exact = codec::bf16_to_float(res_out[i]) * inv * w[k];
      // bf16 output: half an ulp (2^-9 relative) plus a few fp32 roundings.
      ASSERT_LE(std::fabs(codec::bf16_to_float(y[i]) - exact), std::ldexp(std::fabs(exact), -8) + 1e-30) << t << "," << k;
    }
  }
}

struct ProtocolCase {
  int32_t world;
  AllReduceAlgo algo;
  int32_t num_blocks;
  int64_t n;
};

TEST(AllReduce, ThreadProtocolEqualsOracleByteForByte) {
  const std::vector<ProtocolCase> cases = {
      {1, AllReduceAlgo::kOneShot, 1, 4096},  {2, AllReduceAlgo::kOneShot, 3, 8 * 1000},
      {3, AllReduceAlgo::kTwoShot, 2, 8 * 777}, {4, AllReduceAlgo::kTwoShot, 7, 8 * 2048 * 3},
      {8, AllReduceAlgo::kOneShot, 4, 8 * 513}, {8, AllReduceAlgo::kTwoShot, 5, 8 * 5},  // fewer vectors than ranks
      {5, AllReduceAlgo::kAuto, 0, 8 * 4096},
  };
  for (const ProtocolCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "W " << c.world << " " << to_string(c.algo) << " blocks " << c.num_blocks
                                      << " n " << c.n);
    HostWorld world(c.world, c.n);
    std::vector<std::vector<uint16_t>> in, out(c.world, std::vector<uint16_t>(c.n, kPoison));
    std::vector<const uint16_t*> ptrs;
    for (int32_t r = 0; r < c.world; ++r) in.push_back(test::random_bf16(1, c.n, 400 + r));
    for (auto& v : in) ptrs.push_back(v.data());
    std::vector<uint16_t> expect(c.n);
    allreduce_reference(ptrs, c.n, expect.data());
    run_threads(c.world, [&](int32_t r) {
      HostAllReduceArgs a = world.args(r);
      a.algo = c.algo;
      a.num_blocks = c.num_blocks;
      a.num_elems = c.n;
      a.in = in[r].data();
      a.out = out[r].data();
      host_allreduce(a);
    });
    for (int32_t r = 0; r < c.world; ++r) ASSERT_EQ(out[r], expect) << "rank " << r;
  }
}

TEST(AllReduce, ConsecutiveCallsWithChangingSizesAndBlocksStayInStep) {
  // Epoch parity alternates per call; block counts and algorithms change from call to call (the case that
  // breaks per-block epochs). Inputs change every call, so a stale read would show.
  const int32_t W = 4;
  const int64_t max_elems = 8 * 3000;
  HostWorld world(W, max_elems);
  const std::vector<std::pair<int64_t, int32_t>> calls = {{8 * 3000, 6}, {8 * 100, 1}, {8 * 2999, 3}, {8 * 7, 2},
                                                          {8 * 3000, 5}, {8 * 1, 1},   {8 * 1500, 4}};
  for (size_t call = 0; call < calls.size(); ++call) {
    const auto [n, blocks] = calls[call];
    const AllReduceAlgo algo = call % 2 ? AllReduceAlgo::kOneShot : AllReduceAlgo::kTwoShot;
    std::vector<std::vector<uint16_t>> in, out(W, std::vector<uint16_t>(n, kPoison));
    std::vector<const uint16_t*> ptrs;
    for (int32_t r = 0; r < W; ++r) in.push_back(test::random_bf16(1, n, 1000 * call + r));
    for (auto& v : in) ptrs.push_back(v.data());
    std::vector<uint16_t> expect(n);
    allreduce_reference(ptrs, n, expect.data());
    run_threads(W, [&](int32_t r) {
      HostAllReduceArgs a = world.args(r);
      a.algo = algo;
      a.num_blocks = blocks;
      a.num_elems = n;
      a.in = in[r].data();
      a.out = out[r].data();
      host_allreduce(a);
    });
    for (int32_t r = 0; r < W; ++r) ASSERT_EQ(out[r], expect) << "call " << call << " rank " << r;
  }
  for (int32_t r = 0; r < W; ++r) {
    uint32_t epoch = 0;
    std::memcpy(&epoch, world.ws[r].data() + AllReduceLayout::kEpochOffset, 4);
    EXPECT_EQ(epoch, calls.size());
  }
}

TEST(AllReduce, FusedThreadProtocolEqualsOracle) {
  for (const AllReduceAlgo algo : {AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot}) {
    for (const bool alias : {false, true}) {
      const int32_t W = 4;
      const int64_t T = 7, H = 7168;  // 7 rows over 4 ranks: uneven segments
      SCOPED_TRACE(::testing::Message() << to_string(algo) << (alias ? " residual in place" : ""));
      HostWorld world(W, T * H);
      std::vector<std::vector<uint16_t>> in;
      std::vector<const uint16_t*> ptrs;
      for (int32_t r = 0; r < W; ++r) in.push_back(test::random_bf16(T, H, 500 + r));
      for (auto& v : in) ptrs.push_back(v.data());
      const std::vector<uint16_t> residual = test::random_bf16(T, H, 600);
      const std::vector<float> w = test::random_weights(H, 601);
      const AllReduceNorm norm{H, w.data(), 1e-6f};
      std::vector<uint16_t> expect_res(T * H), expect_y(T * H);
      allreduce_rmsnorm_reference(ptrs, T, norm, residual.data(), expect_res.data(), expect_y.data());
      std::vector<std::vector<uint16_t>> res_in(W, residual), res_out(W, std::vector<uint16_t>(T * H, kPoison)),
          y(W, std::vector<uint16_t>(T * H, kPoison));
      run_threads(W, [&](int32_t r) {
        HostAllReduceArgs a = world.args(r);
        a.algo = algo;
        a.num_blocks = 3;
        a.num_elems = T * H;
        a.in = in[r].data();
        a.out = y[r].data();
        a.fused = true;
        a.norm = norm;
        a.residual_in = res_in[r].data();
        a.residual_out = alias ? res_in[r].data() : res_out[r].data();
        host_allreduce(a);
      });
      for (int32_t r = 0; r < W; ++r) {
        ASSERT_EQ(y[r], expect_y) << "rank " << r;
        ASSERT_EQ(alias ? res_in[r] : res_out[r], expect_res) << "rank " << r;
      }
    }
  }
}

TEST(AllReduce, MissingPeerEndsInFenceTimeoutNamingIt) {
  HostWorld world(3, 4096);
  std::vector<uint16_t> in = test::random_bf16(1, 4096, 7), out(4096);
  HostAllReduceArgs a = world.args(0);
  a.algo = AllReduceAlgo::kOneShot;
  a.num_elems = 4096;
  a.in = in.data();
  a.out = out.data();
  a.timeout_ms = 50;
  // Rank 1 arrives (its signal is already there), rank 2 never does.
  std::memcpy(world.ws[0].data() + AllReduceLayout::signal_offset(0, 0, 1, 1), "\1\0\0\0", 4);
  try {
    host_allreduce(a);
    FAIL() << "no timeout";
  } catch (const FenceTimeout& e) {
    EXPECT_EQ(e.missing_rank(), 2);
    EXPECT_NE(std::string(e.what()).find("rank 2 never arrived"), std::string::npos) << e.what();
  }
  uint32_t err = 0;
  std::memcpy(&err, world.ws[0].data() + AllReduceLayout::kErrorOffset, 4);
  EXPECT_EQ(err, 3u);
}

TEST(AllReduce, ValidationNamesFieldAndValue) {
  AllReduceLayout layout;
  layout.max_elems = 1024;
  const AllReduceNorm none;
  EXPECT_NE(error_of([&] { validate_allreduce(9, 0, layout, 8, false, none); }).find("world_size = 9"), std::string::npos);
  EXPECT_NE(error_of([&] { validate_allreduce(2, 2, layout, 8, false, none); }).find("rank = 2"), std::string::npos);
  EXPECT_NE(error_of([&] { validate_allreduce(2, 0, layout, 12, false, none); }).find("num_elems = 12"), std::string::npos);
  EXPECT_NE(error_of([&] { validate_allreduce(2, 0, layout, 2048, false, none); }).find("max_elems = 1024"),
            std::string::npos);
  const float w[16] = {};
  EXPECT_NE(error_of([&] { validate_allreduce(2, 0, layout, 960, true, AllReduceNorm{100, w, 1e-6f}); }).find("hidden = 100"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate_allreduce(2, 0, layout, 960, true, AllReduceNorm{16, nullptr, 1e-6f}); }).find("weight"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_allreduce_algo("ring"); }).find("'ring'"), std::string::npos);
}

// A huge algorithm name was quoted whole (100 KB in, a 100 KB message out): clipped (input_limits.h clip), what
// it names and the known names still in the message.
TEST(AllReduce, UnknownAlgorithmNamesAreQuotedClipped) {
  test::expect_clipped_error(error_of([] { parse_allreduce_algo(std::string(100000, 'r')); }),
                             "all-reduce algorithm: 'rrr", "is not one of auto, oneshot, twoshot");
}

TEST(AllReduce, PartitionCoversEveryItemOnceAndDispatchIsMonotone) {
  for (const int64_t items : {0, 1, 5, 255, 256, 257, 10000}) {
    for (const int32_t segs : {1, 3, 8}) {
      AllReducePartition p{items, 256, segs, 1};
      p.num_blocks = allreduce_num_blocks(p, 5);
      std::vector<int> seen(items, 0);
      for (int32_t q = 0; q < segs; ++q)
        for (int32_t b = 0; b < p.num_blocks; ++b)
          for (int64_t c = b; c < p.num_chunks(q); c += p.num_blocks)
            for (int64_t i = p.segment_begin(q) + c * 256; i < std::min(p.segment_end(q), p.segment_begin(q) + (c + 1) * 256); ++i)
              ++seen[i];
      for (int64_t i = 0; i < items; ++i) ASSERT_EQ(seen[i], 1) << items << " " << segs << " " << i;
    }
  }
  for (const int32_t w : {2, 4, 8}) {
    bool seen_two = false;
    for (int64_t bytes = 1024; bytes <= (int64_t{64} << 20); bytes *= 2) {
      const AllReduceAlgo a = choose_allreduce_algo(bytes, w);
      if (seen_two) {
        EXPECT_EQ(a, AllReduceAlgo::kTwoShot) << "monotone";
      }
      seen_two = seen_two || a == AllReduceAlgo::kTwoShot;
    }
    EXPECT_EQ(choose_allreduce_algo(4096, w), AllReduceAlgo::kOneShot);
    bool seen_two_fused = false;
    for (int64_t bytes = 1024; bytes <= (int64_t{64} << 20); bytes *= 2) {
      const AllReduceAlgo a = choose_allreduce_algo(bytes, w, true);
      if (seen_two_fused) {
        EXPECT_EQ(a, AllReduceAlgo::kTwoShot) << "monotone (fused)";
      }
      seen_two_fused = seen_two_fused || a == AllReduceAlgo::kTwoShot;
    }
    EXPECT_EQ(choose_allreduce_algo(4096, w, true), AllReduceAlgo::kOneShot);
  }
  // The measured crossovers (H200, W logical ranks on one GPU; src/serving/drivers/allreduce_dispatch.cpp).
  EXPECT_EQ(choose_allreduce_algo(int64_t{4} << 20, 2), AllReduceAlgo::kOneShot);
  EXPECT_EQ(choose_allreduce_algo(int64_t{16} << 20, 2), AllReduceAlgo::kTwoShot);
  EXPECT_EQ(choose_allreduce_algo(int64_t{1} << 20, 4), AllReduceAlgo::kOneShot);
  EXPECT_EQ(choose_allreduce_algo(int64_t{4} << 20, 4), AllReduceAlgo::kTwoShot);
  EXPECT_EQ(choose_allreduce_algo(786432, 8), AllReduceAlgo::kOneShot);
  EXPECT_EQ(choose_allreduce_algo(int64_t{1} << 20, 8), AllReduceAlgo::kTwoShot);
  EXPECT_EQ(choose_allreduce_algo(98304, 8, true), AllReduceAlgo::kOneShot);
  EXPECT_EQ(choose_allreduce_algo(786432, 8, true), AllReduceAlgo::kTwoShot);
  EXPECT_EQ(choose_allreduce_algo(786432, 4, true), AllReduceAlgo::kOneShot);
  // W = 2 fused, measured across 2 GPUs: one-shot up to 768 KiB, two-shot from 1536 KiB.
  EXPECT_EQ(choose_allreduce_algo(786432, 2, true), AllReduceAlgo::kOneShot);
  EXPECT_EQ(choose_allreduce_algo(int64_t{1536} << 10, 2, true), AllReduceAlgo::kTwoShot);
  EXPECT_EQ(choose_allreduce_algo(int64_t{4} << 20, 2, false), AllReduceAlgo::kOneShot);
  EXPECT_THROW(choose_allreduce_algo(4096, 9, true), Error);
  EXPECT_THROW(choose_allreduce_algo(-1, 2), Error);
}

TEST(AllReduce, CapabilityIsAgreedByEveryRank) {
  // Three ranks as threads; rank 1 cannot map a peer. Everyone must get the same "no".
  const int32_t W = 3;
  std::vector<int> votes(W, -1);
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  bool all_ok = true;
  const AllRanksAnd and_fn = [&](bool ok) {
    std::unique_lock<std::mutex> lock(mu);
    all_ok = all_ok && ok;
    if (++arrived == W) cv.notify_all();
    cv.wait(lock, [&] { return arrived == W; });
    return all_ok;
  };
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < W; ++r)
    threads.emplace_back([&, r] { votes[r] = agree_capability(r != 1, and_fn) ? 1 : 0; });
  for (auto& t : threads) t.join();
  EXPECT_EQ(votes, (std::vector<int>{0, 0, 0}));
}

}  // namespace
}  // namespace pcpkv
