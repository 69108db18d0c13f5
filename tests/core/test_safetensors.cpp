// pcpkv-test-labels: unit
// safetensors reader/writer (include/pcpkv/core/safetensors.h): round trips of every dtype, the exact byte
// layout of the format, and every malformed-file error (each names the tensor and the offset).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "pcpkv/core/error.h"
#include "pcpkv/core/safetensors.h"
#include "support/error_of.h"

namespace fs = std::filesystem;
using pcpkv::SafetensorsReader;
using pcpkv::SafetensorsWriter;
using pcpkv::StDtype;

namespace {

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / (std::string("pcpkv_st_") + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A file built by hand, the way the reference implementation lays it out.
std::vector<uint8_t> raw_file(const std::string& header, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out;
  out.reserve(8 + header.size() + data.size());
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));
  for (char c : header) out.push_back(static_cast<uint8_t>(c));
  for (uint8_t b : data) out.push_back(b);
  return out;
}

using pcpkv::test::error_of;

template <class T>
std::vector<T> random_vector(size_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> v(n);
  for (auto& x : v) {
    uint64_t r = rng();
    std::memcpy(&x, &r, sizeof(T));
  }
  return v;
}

}  // namespace

TEST(Safetensors, DtypeNamesAndSizes) {
  EXPECT_STREQ(pcpkv::to_string(StDtype::kBF16), "BF16");
  EXPECT_EQ(pcpkv::dtype_bytes(StDtype::kBF16), 2);
  EXPECT_EQ(pcpkv::dtype_bytes(StDtype::kF32), 4);
  EXPECT_EQ(pcpkv::dtype_bytes(StDtype::kI64), 8);
  EXPECT_EQ(pcpkv::dtype_bytes(StDtype::kI32), 4);
  EXPECT_EQ(pcpkv::dtype_bytes(StDtype::kU8), 1);
  for (const char* s : {"BF16", "F32", "I64", "I32", "U8"}) {
    EXPECT_STREQ(pcpkv::to_string(pcpkv::parse_st_dtype(s, "t")), s);
  }
  const std::string msg = error_of([] { pcpkv::parse_st_dtype("F16", "tensor 'x'"); });
  EXPECT_NE(msg.find("tensor 'x'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'F16'"), std::string::npos) << msg;
}

TEST(Safetensors, RoundTripEveryDtype) {
  TempDir dir;
  // Random bit patterns, NaN payloads included: the format must carry bytes, not values.
  const auto bf16 = random_vector<uint16_t>(7 * 13, 1);
  const auto f32 = random_vector<float>(5 * 3 * 2, 2);
  const auto i64 = random_vector<int64_t>(11, 3);
  const auto i32 = random_vector<int32_t>(9 * 4, 4);
  const auto u8 = random_vector<uint8_t>(1001, 5);
  SafetensorsWriter w;
  w.add("a.bf16", StDtype::kBF16, {7, 13}, bf16);
  w.add("f32", StDtype::kF32, {5, 3, 2}, f32);
  w.add("i64", StDtype::kI64, {11}, i64);
  w.add("i32", StDtype::kI32, {9, 4}, i32);
  w.add("u8", StDtype::kU8, {1001}, u8);
  w.add("empty", StDtype::kF32, {0, 512}, nullptr, 0);
  w.add("scalar", StDtype::kI64, {}, i64.data(), 8);
  w.set_metadata("kv_format", "fp8_ds_mla");
  w.set_metadata("note", "quotes \" and \\ survive");
  const std::string path = dir.file("rt.safetensors");
  w.write(path);
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(path)), w.file_bytes());

  const SafetensorsReader r(path);
  EXPECT_EQ(r.data_start() % 8, 0) << "header padded so the data starts 8-byte aligned";
  ASSERT_EQ(r.tensors().size(), 7u);
  EXPECT_EQ(r.metadata().at("kv_format"), "fp8_ds_mla");
  EXPECT_EQ(r.metadata().at("note"), "quotes \" and \\ survive");
  EXPECT_EQ(r.read_as<uint16_t>("a.bf16", StDtype::kBF16, {7, 13}), bf16);
  const auto f32_back = r.read_as<float>("f32", StDtype::kF32, {5, 3, 2});
  ASSERT_EQ(f32_back.size(), f32.size());
  EXPECT_EQ(std::memcmp(f32_back.data(), f32.data(), f32.size() * 4), 0);
  EXPECT_EQ(r.read_as<int64_t>("i64", StDtype::kI64, {11}), i64);
  EXPECT_EQ(r.read_as<int32_t>("i32", StDtype::kI32, {-1, 4}), i32);
  EXPECT_EQ(r.read_bytes("u8"), u8);
  EXPECT_TRUE(r.read_as<float>("empty", StDtype::kF32, {0, 512}).empty());
  EXPECT_EQ(r.read_as<int64_t>("scalar", StDtype::kI64, {}), std::vector<int64_t>{i64[0]});
  EXPECT_EQ(r.get("i32").shape, (std::vector<int64_t>{9, 4}));
  // No temporary file left behind.
  int64_t num_files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) num_files += e.is_regular_file();
  EXPECT_EQ(num_files, 1);
}

TEST(Safetensors, WriterProducesTheReferenceByteLayout) {
  TempDir dir;
  const std::vector<float> v = {1.0f, -2.5f};
  SafetensorsWriter w;
  w.add("w", StDtype::kF32, {2}, v);
  const std::string path = dir.file("w.safetensors");
  w.write(path);
  const auto bytes = read_file(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(n));
  // Little-endian length, compact JSON padded with spaces, data right after.
  EXPECT_EQ(header.rfind(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 0), 0u) << header;
  EXPECT_EQ((8 + n) % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 8);
  float back[2];
  std::memcpy(back, bytes.data() + 8 + n, 8);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], -2.5f);
}

TEST(Safetensors, ReadsAHandBuiltFile) {
  TempDir dir;
  // Order in the header differs from data order; the reader sorts by offset.
  const std::string header = R"({"__metadata__":{"format":"pt"},"b":{"dtype":"U8","shape":[3],"data_offsets":[4,7]},)"
                             R"("a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})";
  const std::vector<uint8_t> data = {0x78, 0x56, 0x34, 0x12, 9, 8, 7};
  const std::string path = dir.file("hand.safetensors");
  write_file(path, raw_file(header, data));
  const SafetensorsReader r(path);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.tensors()[0].name, "a");
  EXPECT_EQ(r.read_as<int32_t>("a", StDtype::kI32, {1})[0], 0x12345678);
  EXPECT_EQ(r.read_bytes("b"), (std::vector<uint8_t>{9, 8, 7}));
}

// An empty tensor at the offset where the next tensor's data begins, as the safetensors package (0.8) writes
// it when the empty one sorts first (here 'z', an I64 placed before the F32 'a'): it was refused as "tensor 'z':
// data [4, 4) overlaps tensor 'a'", since tensors of one begin kept their header (name) order.
TEST(Safetensors, AnEmptyTensorBeforeTheNextOneIsRead) {
  TempDir dir;
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                             R"("x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                             R"("z":{"dtype":"I64","shape":[0],"data_offsets":[4,4]}})";
  const std::string path = dir.file("empty.safetensors");
  write_file(path, raw_file(header, {1, 2, 3, 4, 0, 0, 0x80, 0x3f}));
  const SafetensorsReader r(path);
  EXPECT_TRUE(r.read_as<int64_t>("z", StDtype::kI64, {0}).empty());
  EXPECT_EQ(r.read_as<float>("a", StDtype::kF32, {1})[0], 1.0f);
  EXPECT_EQ(r.read_bytes("x"), (std::vector<uint8_t>{1, 2, 3, 4}));
}

TEST(Safetensors, WrongDtypeOrShapeNamesTheTensor) {
  TempDir dir;
  const std::vector<float> kv(4 * 512, 0.5f);
  SafetensorsWriter w;
  w.add("kv", StDtype::kF32, {4, 512}, kv);
  const std::string path = dir.file("kv.safetensors");
  w.write(path);
  const SafetensorsReader r(path);
  std::string msg = error_of([&] { r.read_as<uint16_t>("kv", StDtype::kBF16, {4, 512}); });
  EXPECT_NE(msg.find("tensor 'kv'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected BF16 [4, 512], got F32 [4, 512]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("file offset"), std::string::npos) << msg;
  msg = error_of([&] { r.read_as<float>("kv", StDtype::kF32, {4, 576}); });
  EXPECT_NE(msg.find("expected F32 [4, 576], got F32 [4, 512]"), std::string::npos) << msg;
  msg = error_of([&] { r.read_as<float>("kv", StDtype::kF32, {2048}); });
  EXPECT_NE(msg.find("expected F32 [2048], got F32 [4, 512]"), std::string::npos) << msg;
  msg = error_of([&] { r.read_bytes("k_pe"); });
  EXPECT_NE(msg.find("tensor 'k_pe' is missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("present: kv"), std::string::npos) << msg;
}

TEST(Safetensors, TruncatedFilesAreDetected) {
  TempDir dir;
  const std::vector<uint16_t> a(1000, 0x3f80), b(3000, 0x4000);
  SafetensorsWriter w;
  w.add("a", StDtype::kBF16, {1000}, a);
  w.add("b", StDtype::kBF16, {10, 300}, b);
  const std::string good = dir.file("good.safetensors");
  w.write(good);
  const auto bytes = read_file(good);
  const int64_t data_start = SafetensorsReader(good).data_start();

  struct Case {
    int64_t keep;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {static_cast<int64_t>(bytes.size()) - 1, "tensor 'b'"},  // last byte of b missing
      {data_start + 2000 + 10, "tensor 'b'"},                  // b barely begun
      {data_start + 1000, "tensor 'a'"},                       // a cut in half
      {data_start - 5, "JSON header at offset 8"},             // inside the header
      {5, "header length at offset 0"},                        // inside the length
      {0, "header length at offset 0"},
  };
  for (const Case& c : cases) {
    const std::string path = dir.file("cut.safetensors");
    write_file(path, std::vector<uint8_t>(bytes.begin(), bytes.begin() + c.keep));
    const std::string msg = error_of([&] { SafetensorsReader r(path); });
    EXPECT_NE(msg.find("truncated"), std::string::npos) << "keep " << c.keep << ": " << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << "keep " << c.keep << ": " << msg;
    EXPECT_NE(msg.find("offset"), std::string::npos) << msg;
  }
  // The message gives the absolute byte range of the tensor that runs past the end.
  const std::string path = dir.file("cut.safetensors");
  write_file(path, std::vector<uint8_t>(bytes.begin(), bytes.end() - 1));
  const std::string msg = error_of([&] { SafetensorsReader r(path); });
  EXPECT_NE(msg.find(fmt::format("[{}, {})", data_start + 2000, data_start + 8000)), std::string::npos) << msg;
}

TEST(Safetensors, MalformedHeadersNameTheProblem) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  struct Case {
    std::string header;
    size_t data_bytes;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", 4, {"tensor 'x'", "'F16'"}},
      {R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, {"tensor 'x'", "hold 8 bytes", "needs 12"}},
      {R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, {"tensor 'x'", "negative"}},
      {R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"y":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
       6,
       {"tensor 'y'", "overlaps tensor 'x'"}},
      {R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6, {"tensor 'x'", "gap"}},
      {R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 9, {"5 trailing bytes"}},
      {R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[4,0]}})", 4, {"tensor 'x'", "end before they begin"}},
      {R"({"x":{"dtype":"U8","shape":[4]}})", 4, {"tensor 'x'", "data_offsets"}},
      {R"({"x":{"dtype":"U8","shape":"4","data_offsets":[0,4]}})", 4, {"tensor 'x'", "shape"}},
      {R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]})", 4, {"JSON header is invalid", "offset"}},
      {R"({"__metadata__":{"k":3}})", 0, {"__metadata__['k']"}},
      {R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"offsets":[0,4]}})", 4,
       {"tensor 'x'", "unknown field 'offsets'", "dtype, shape and data_offsets"}},
      {R"([1,2])", 0, {"not an object"}},
  };
  for (const Case& c : cases) {
    write_file(path, raw_file(c.header, std::vector<uint8_t>(c.data_bytes, 7)));
    const std::string msg = error_of([&] { SafetensorsReader r(path); });
    for (const auto& e : c.expect) EXPECT_NE(msg.find(e), std::string::npos) << c.header << " -> " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
  }
  // A length word that is not a safetensors header at all.
  std::vector<uint8_t> junk(64, 0xff);
  write_file(path, junk);
  const std::string msg = error_of([&] { SafetensorsReader r(path); });
  EXPECT_NE(msg.find("header length"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { SafetensorsReader r(dir.file("missing.safetensors")); }).find("no such file"),
            std::string::npos);
}

// Offsets near INT64_MAX must not overflow when the message adds the header size (it printed
// "file offsets [105, -9223372036854775704)"); a number too large for a double names the file.
TEST(Safetensors, HugeOffsetsGiveMessagesWithoutOverflow) {
  TempDir dir;
  const std::string path = dir.file("huge.safetensors");
  const std::string max = "9223372036854775807";  // 2^63 - 1
  for (const std::string& header :
       {R"({"x":{"dtype":"U8","shape":[)" + max + R"(],"data_offsets":[0,)" + max + "]}}",
        R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"x":{"dtype":"U8","shape":[1],"data_offsets":[)" +
            max + "," + max + "]}}"}) {
    write_file(path, raw_file(header, std::vector<uint8_t>(4, 7)));
    const std::string msg = error_of([&] { SafetensorsReader r(path); });
    EXPECT_NE(msg.find("tensor 'x'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(max), std::string::npos) << msg;
    EXPECT_EQ(msg.find("-9223"), std::string::npos) << "overflowed: " << msg;
    EXPECT_EQ(msg.find(path), 0u) << msg;
  }
  write_file(path, raw_file(R"({"x":{"dtype":"U8","shape":[1e999],"data_offsets":[0,4]}})", std::vector<uint8_t>(4)));
  const std::string msg = error_of([&] { SafetensorsReader r(path); });
  EXPECT_EQ(msg.find(path), 0u) << msg;
  EXPECT_NE(msg.find("overflow"), std::string::npos) << msg;
}

TEST(Safetensors, WriterRefusesBadTensorsAndLeavesNoFile) {
  TempDir dir;
  const std::vector<float> v(6, 1.0f);
  SafetensorsWriter w;
  w.add("v", StDtype::kF32, {2, 3}, v);
  EXPECT_NE(error_of([&] { w.add("v", StDtype::kF32, {6}, v); }).find("added twice"), std::string::npos);
  EXPECT_NE(error_of([&] { w.add("u", StDtype::kF32, {7}, v); }).find("tensor 'u'"), std::string::npos);
  EXPECT_NE(error_of([&] { w.add("__metadata__", StDtype::kF32, {6}, v); }).find("invalid tensor name"),
            std::string::npos);
  EXPECT_NE(error_of([&] { w.add("n", StDtype::kF32, {-1}, v); }).find("negative"), std::string::npos);
  const std::string path = (dir.path() / "no_such_dir" / "x.safetensors").string();
  const std::string msg = error_of([&] { w.write(path); });
  EXPECT_NE(msg.find("cannot create"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(path));
}
