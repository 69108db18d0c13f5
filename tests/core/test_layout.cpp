// pcpkv-test-labels: unit
// Byte layouts (SPEC section 3): row sizes, offsets in 64 bits, strides, staging geometry.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <optional>
#include <string>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/layout.h"
#include "support/error_of.h"

namespace pcpkv {
namespace {

using test::error_of;

TEST(Layout, RowSizes) {
  EXPECT_EQ(mla_row_bytes(KvFormat::kBf16), 1152);
  EXPECT_EQ(mla_row_bytes(KvFormat::kFp8), 576);
  EXPECT_EQ(mla_row_bytes(KvFormat::kFp8DsMla), 656);
  EXPECT_EQ(kDsMlaScaleOffset, 512);
  EXPECT_EQ(kDsMlaKpeOffset, 528);
  EXPECT_EQ(kDsMlaKpeOffset + 64 * 2, 656);
}

TEST(Layout, TransportRows) {
  CacheFormat f;
  f.kv_format = KvFormat::kFp8;
  EXPECT_EQ(transport_row_layout(f).row_bytes, 720);
  EXPECT_EQ(transport_row_layout(f).index_data_offset, 576);
  EXPECT_EQ(transport_row_layout(f).index_scale_offset, 704);
  f.kv_format = KvFormat::kFp8DsMla;
  EXPECT_EQ(transport_row_layout(f).row_bytes, 800);
  EXPECT_EQ(transport_row_layout(f).index_data_offset, 656);
  EXPECT_EQ(transport_row_layout(f).index_scale_offset, 784);
  f.kv_format = KvFormat::kBf16;
  EXPECT_EQ(transport_row_layout(f).row_bytes, 1296);
  f.has_indexer = false;
  EXPECT_EQ(transport_row_layout(f).row_bytes, 1152);
  EXPECT_EQ(transport_row_layout(f).index_data_offset, -1);
  f.kv_format = KvFormat::kFp8DsMla;
  EXPECT_EQ(transport_row_layout(f).row_bytes, 656);
}

TEST(Layout, MlaOffsetsUse64Bits) {
  MlaCacheGeometry g = dense_mla_geometry(KvFormat::kFp8DsMla, 200000, 64);  // 12.8M slots, 8.4 GB
  EXPECT_EQ(g.bytes(), int64_t{200000} * 64 * 656);
  const int64_t slot = int64_t{199999} * 64 + 63;
  EXPECT_EQ(g.row_offset(slot), slot * 656);
  EXPECT_GT(g.row_offset(slot), int64_t{1} << 32);
  // Padded strides.
  g.row_stride = 672;
  g.block_stride = 64 * 672 + 4096;
  EXPECT_EQ(g.row_offset(64 * 3 + 5), 3 * (64 * 672 + 4096) + 5 * 672);
  EXPECT_NO_THROW(validate_geometry(g, KvFormat::kFp8DsMla));
}

TEST(Layout, IndexerOffsets) {
  // vLLM DeepseekV32IndexerCache: block b holds B rows of 128 B, then B fp32 scales.
  IndexerCacheGeometry g = dense_indexer_geometry(10, 64);
  EXPECT_EQ(g.block_stride, 64 * 132);
  EXPECT_EQ(g.data_offset(64 * 2 + 3), 2 * 64 * 132 + 3 * 128);
  EXPECT_EQ(g.scale_offset(64 * 2 + 3), 2 * 64 * 132 + 64 * 128 + 3 * 4);
  g.block_stride = 64 * 132 + 64;  // padded
  EXPECT_EQ(g.scale_offset(64 * 2 + 3), 2 * (64 * 132 + 64) + 64 * 128 + 12);
  EXPECT_NO_THROW(validate_geometry(g));
  IndexerCacheGeometry big = dense_indexer_geometry(1 << 20, 64);
  EXPECT_EQ(big.scale_offset((int64_t{1} << 26) - 1), int64_t{(1 << 20) - 1} * 64 * 132 + 64 * 128 + 63 * 4);
}

TEST(Layout, BadGeometries) {
  MlaCacheGeometry g = dense_mla_geometry(KvFormat::kFp8DsMla, 4, 64);
  g.row_stride = 576;
  EXPECT_THROW(validate_geometry(g, KvFormat::kFp8DsMla), Error);
  g = dense_mla_geometry(KvFormat::kFp8, 4, 48);
  EXPECT_THROW(validate_geometry(g, KvFormat::kFp8), Error);
  g = dense_mla_geometry(KvFormat::kFp8, 4, 64);
  g.block_stride -= 16;
  EXPECT_THROW(validate_geometry(g, KvFormat::kFp8), Error);
  IndexerCacheGeometry ig = dense_indexer_geometry(4, 64);
  ig.block_stride = 64 * 132 - 4;
  EXPECT_THROW(validate_geometry(ig), Error);
  try {
    parse_kv_format("fp4");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "--kv-format: unknown kv cache format 'fp4'; known: bf16, fp8, fp8_ds_mla");
  }
}

// A huge name was quoted whole (a 1 MB --kv-format value gave a 1 MB error line): clipped like every quoted value
// (input_limits.h clip, kMaxQuotedChars), the known names still listed after it.
TEST(Layout, UnknownFormatNamesAreQuotedClipped) {
  const std::string huge(100000, 'x');
  const std::string clipped = clip(huge);
  EXPECT_EQ(error_of([&] { parse_kv_format(huge, "kv-format"); }),
            "--kv-format: unknown kv cache format '" + clipped + "'; known: bf16, fp8, fp8_ds_mla");
  EXPECT_EQ(error_of([&] { parse_ds_mla_scale(huge, "ds-mla-scale"); }),
            "--ds-mla-scale: unknown fp8_ds_mla scale rule '" + clipped + "'; known: pow2, raw");
  EXPECT_LT(error_of([&] { parse_kv_format(huge); }).size(), 400u);
}

// Fuzz finding (fuzz_cache_targets, corpus huge-counts): sizes whose products overflow int64 were signed
// overflow inside validate_geometry; now refused naming the fields, and the largest accepted cache addresses
// its last row without overflow.
TEST(Layout, HugeGeometriesRefusedWithoutOverflow) {
  MlaCacheGeometry g{int64_t{1} << 62, 1 << 30, int64_t{1} << 40, int64_t{1} << 62};
  EXPECT_EQ(error_of([&] { validate_geometry(g, KvFormat::kFp8DsMla); }),
            "mla cache: row_stride = 1099511627776 B times block_size = 1073741824 exceeds 281474976710656 B");
  g = dense_mla_geometry(KvFormat::kBf16, int64_t{1} << 40, 64);
  EXPECT_EQ(error_of([&] { validate_geometry(g, KvFormat::kBf16); }),
            "mla cache: num_blocks = 1099511627776 times block_stride = 73728 B exceeds 281474976710656 B");
  IndexerCacheGeometry ig{int64_t{1} << 62, 64, int64_t{1} << 40};
  EXPECT_EQ(error_of([&] { validate_geometry(ig); }),
            "indexer cache: num_blocks = 4611686018427387904 times block_stride = 1099511627776 B exceeds "
            "281474976710656 B");
  g = dense_mla_geometry(KvFormat::kFp8DsMla, kMaxCacheBytes / (64 * 656), 64);
  EXPECT_NO_THROW(validate_geometry(g, KvFormat::kFp8DsMla));
  EXPECT_LE(g.row_offset(g.num_slots() - 1) + 656, g.bytes());
}

// scale_problem: the normal float32 range, decided on the value given. Subnormal k_scales (1e-45, 1e-39) were
// accepted by the C++ format checks (only 0, negatives and non-finite values were refused), so x / k_scale was inf
// for every |x| > 2^-21.
TEST(Layout, ScaleProblemAcceptsExactlyTheNormalFloat32Range) {
  for (double ok : {static_cast<double>(FLT_MIN), 0.05, 1.0, 0.135234, 3.4e38, static_cast<double>(FLT_MAX)})
    EXPECT_EQ(scale_problem(ok), std::nullopt) << ok;
  const double below_min = std::nextafter(static_cast<double>(FLT_MIN), 0.0);  // rounds to FLT_MIN as a float
  const double above_max = std::nextafter(static_cast<double>(FLT_MAX), 1e300);
  for (double bad : {0.0, -0.0, -1.0, -static_cast<double>(FLT_MAX), 1e-45, 1e-39, 1e-300, below_min, above_max,
                     1e39, 1e300, static_cast<double>(NAN), static_cast<double>(INFINITY),
                     -static_cast<double>(INFINITY)}) {
    const std::optional<std::string> why = scale_problem(bad);
    ASSERT_TRUE(why.has_value()) << bad;
    EXPECT_EQ(*why,
              "must be a finite, positive, normal float32 (in [2^-126, 3.4e38]; 0, negatives, subnormals such as "
              "1e-45, nan and inf are refused)")
        << bad;
  }
}

TEST(Layout, StagingGeometry) {
  StagingGeometry s{2, 8, 4100, 800};
  EXPECT_EQ(s.bytes(), int64_t{2} * 2 * 8 * 4100 * 800);
  EXPECT_EQ(s.row_offset(1, 1, 7, 4099), s.bytes() - 800);
  EXPECT_EQ(s.row_offset(0, 0, 3, 5), (3 * 4100 + 5) * 800);
}

}  // namespace
}  // namespace pcpkv
