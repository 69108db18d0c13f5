// pcpkv-test-labels: unit
// The public kernel entry points compile in a plain C++ translation unit without any CUDA header: the
// publication launchers (pcpkv/publish/kernels.h), the consumer and serving entry points, the device
// headers shared with the CPU oracles. A CUDA include among them fails this file (CUDART_VERSION below,
// or a missing header in a CPU-only build).
#include <gtest/gtest.h>

#include <cstdint>
#include <type_traits>

#include "pcpkv/consumers/indexer.h"
#include "pcpkv/consumers/lse_merge.h"
#include "pcpkv/consumers/sparse_mla.h"
#include "pcpkv/core/error.h"
#include "pcpkv/device/fence_kernel.h"
#include "pcpkv/device/ptx_ordering.h"
#include "pcpkv/device/replica_hash.h"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/replica_hash.h"
#include "pcpkv/serving/allreduce.h"
#include "pcpkv/serving/router.h"

#if defined(CUDART_VERSION) || defined(__CUDA_RUNTIME_H__) || defined(__CUDA_RUNTIME_API_H__)
#error "a public header included the CUDA runtime"
#endif

namespace {

using pcpkv::cuda::DispatchJob;

// A caller's cudaStream_t is CUstream_st*: the launchers take it unchanged.
static_assert(std::is_same_v<decltype(&pcpkv::cuda::launch_fill_minus_one),
                             void (*)(int32_t*, int64_t, CUstream_st*)>);
static_assert(std::is_same_v<decltype(&pcpkv::cuda::launch_insert_mla),
                             void (*)(const pcpkv::InsertParams*, int, CUstream_st*)>);
static_assert(std::is_same_v<decltype(&pcpkv::cuda::launch_slot_hashes),
                             void (*)(const pcpkv::CacheTarget&, const pcpkv::CacheFormat&, const int64_t*, int64_t,
                                      uint64_t*, CUstream_st*)>);
// The replica check's atomics on the device need 8-byte fields.
static_assert(sizeof(pcpkv::cuda::DeviceHashDiff) == 16);

TEST(PublicHeaders, LaunchersParseTheirNamesAndKeepTheirDefaults) {
  using pcpkv::cuda::DispatchVariant;
  using pcpkv::cuda::parse_dispatch_variant;
  EXPECT_EQ(pcpkv::cuda::kDefaultCombineRowsPerWarp, 1);
  DispatchJob job;
  EXPECT_TRUE(job.host_targets.empty());
  // The variant names are in pcpkv_core (src/publish/contract/dispatch_variant.cpp): CPU builds have them too.
  EXPECT_EQ(parse_dispatch_variant("warp_pf"), DispatchVariant::kWarpPrefetch);
  EXPECT_STREQ(to_string(DispatchVariant::kSimple), "simple");
  EXPECT_THROW(parse_dispatch_variant("fastest"), pcpkv::Error);
}

}  // namespace
