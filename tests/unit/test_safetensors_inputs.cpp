// Inputs files (inputs_io.h, load_inputs of inputs.h): save_run -> load_inputs round trips bit for bit,
// BF16 or F32 norm weights, the optional requests / slot_mapping tensors, apply_slot_mapping, and the
// cache regions save_run cuts out of an allocation (dense and padded geometries).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "pcpkv/device/codec.h"
#include "pcpkv/error.h"
#include "pcpkv/inputs.h"
#include "pcpkv/inputs_io.h"
#include "pcpkv/layout.h"
#include "pcpkv/model.h"
#include "pcpkv/plan.h"
#include "pcpkv/safetensors.h"

namespace fs = std::filesystem;
using namespace pcpkv;

namespace {

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / (std::string("pcpkv_sti_") + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected pcpkv::Error";
  return {};
}

PlanConfig batch(int32_t pcp) {
  PlanConfig pc;
  pc.pcp_world = pcp;
  pc.block_size = 16;
  pc.seed = 5;
  pc.requests = {{RequestKind::kPrefill, 70, 0}, {RequestKind::kDecode, 1, 33}, {RequestKind::kPrefill, 13, 20}};
  return pc;
}

// A fake result: rank 0's allocations are [guard][cache bytes][guard] with a random cache region.
PublishResult fake_result(const PcpPlan& plan, const CacheFormat& fmt, int64_t row_pad, int64_t index_pad) {
  PublishResult r;
  r.transport = Transport::kDirect;
  r.mla_geometry = dense_mla_geometry(fmt.kv_format, plan.num_blocks, plan.block_size);
  r.mla_geometry.row_stride += row_pad;
  r.mla_geometry.block_stride = r.mla_geometry.row_stride * plan.block_size;
  r.index_geometry = dense_indexer_geometry(plan.num_blocks, plan.block_size);
  r.index_geometry.block_stride += index_pad;
  r.mla_cache_offset = 48;
  r.index_cache_offset = 80;
  std::mt19937 rng(1);
  auto fill = [&](int64_t offset, int64_t bytes) {
    std::vector<uint8_t> v(static_cast<size_t>(offset + bytes + 32), kGuardByte);
    for (int64_t i = 0; i < bytes; ++i) v[static_cast<size_t>(offset + i)] = static_cast<uint8_t>(rng());
    return v;
  };
  r.mla_alloc = {fill(r.mla_cache_offset, r.mla_geometry.bytes())};
  r.index_alloc = {fill(r.index_cache_offset, r.index_geometry.bytes())};
  return r;
}

void expect_same_inputs(const GlobalInputs& a, const GlobalInputs& b) {
  EXPECT_EQ(a.num_tokens, b.num_tokens);
  EXPECT_EQ(a.q_c, b.q_c);
  EXPECT_EQ(a.kv, b.kv);
  EXPECT_EQ(a.k_pe, b.k_pe);
  EXPECT_EQ(a.index_k, b.index_k);
  EXPECT_EQ(a.positions, b.positions);
  auto bits = [](const std::vector<float>& v) {
    std::vector<uint32_t> out(v.size());
    std::memcpy(out.data(), v.data(), v.size() * 4);
    return out;
  };
  EXPECT_EQ(bits(a.weights.q_norm_w), bits(b.weights.q_norm_w));
  EXPECT_EQ(bits(a.weights.kv_norm_w), bits(b.weights.kv_norm_w));
  EXPECT_EQ(bits(a.weights.index_ln_w), bits(b.weights.index_ln_w));
  EXPECT_EQ(bits(a.weights.index_ln_b), bits(b.weights.index_ln_b));
}

}  // namespace

TEST(InputsFile, SaveRunThenLoadInputsRoundTrips) {
  TempDir dir;
  const ModelConfig model = preset("glm-5");
  const PcpPlan plan = make_plan(batch(3));
  const GlobalInputs in = generate_inputs(model, plan, true, 11);
  CacheFormat fmt;  // fp8_ds_mla, indexer
  const PublishResult res = fake_result(plan, fmt, 0, 0);
  const std::string path = dir.file("run.safetensors");
  save_run(path, model, plan, fmt, in, res, SaveInfo{"direct", {{"extra", "yes"}}});

  expect_same_inputs(load_inputs(path, model, plan, true), in);
  const InputsBatch b = read_inputs_batch(path);
  EXPECT_EQ(b.num_tokens, plan.num_global_tokens());
  EXPECT_TRUE(b.has_index_k);
  ASSERT_EQ(b.requests.size(), 3u);
  EXPECT_EQ(b.requests[1].kind, RequestKind::kDecode);
  EXPECT_EQ(b.requests[1].context_len, 33);
  EXPECT_EQ(b.requests[2].num_new_tokens, 13);
  EXPECT_EQ(b.slot_mapping, plan.global_slots);

  const SafetensorsReader r(path);
  EXPECT_EQ(r.metadata().at("extra"), "yes");
  EXPECT_EQ(r.metadata().at("kv_format"), "fp8_ds_mla");
  EXPECT_EQ(r.metadata().at("caches_of"), "rank 0, transport direct");
  // Dense caches keep vLLM's shapes and are exactly the allocation's cache region.
  const auto& mg = res.mla_geometry;
  EXPECT_EQ(r.get("mla_cache").shape, (std::vector<int64_t>{plan.num_blocks, 16, 656}));
  const auto mla = r.read_bytes("mla_cache");
  EXPECT_TRUE(std::equal(mla.begin(), mla.end(), res.mla_alloc[0].begin() + res.mla_cache_offset));
  EXPECT_EQ(static_cast<int64_t>(mla.size()), mg.bytes());
  EXPECT_EQ(r.get("index_cache").shape, (std::vector<int64_t>{plan.num_blocks, 16 * 132}));
  const auto idx = r.read_bytes("index_cache");
  EXPECT_TRUE(std::equal(idx.begin(), idx.end(), res.index_alloc[0].begin() + res.index_cache_offset));
  // Block tables padded with -1; the gathered mapping as [P, max_local_tokens].
  const auto tables = r.read_as<int32_t>("block_tables", StDtype::kI32, {3, -1});
  const int64_t width = r.get("block_tables").shape[1];
  for (size_t q = 0; q < plan.block_tables.size(); ++q) {
    for (int64_t k = 0; k < width; ++k) {
      const int32_t want = k < static_cast<int64_t>(plan.block_tables[q].size()) ? plan.block_tables[q][k] : -1;
      EXPECT_EQ(tables[q * width + k], want);
    }
  }
  EXPECT_EQ(r.read_as<int64_t>("gathered_slot_mapping", StDtype::kI64, {3, plan.max_local_tokens}),
            plan.gathered_slot_mapping);
}

TEST(InputsFile, PaddedGeometriesAndSharedLayers) {
  TempDir dir;
  const ModelConfig model = preset("deepseek-v3.2");
  const PcpPlan plan = make_plan(batch(2));
  const GlobalInputs in = generate_inputs(model, plan, false, 12);
  CacheFormat fmt;
  fmt.kv_format = KvFormat::kFp8;
  fmt.has_indexer = false;
  const PublishResult res = fake_result(plan, fmt, 64, 0);
  const std::string path = dir.file("run.safetensors");
  save_run(path, model, plan, fmt, in, res, SaveInfo{"collect", {}});
  const SafetensorsReader r(path);
  EXPECT_FALSE(r.has("index_k"));
  EXPECT_FALSE(r.has("index_cache"));
  EXPECT_EQ(r.get("mla_cache").shape, (std::vector<int64_t>{plan.num_blocks, 16, 576 + 64}));
  expect_same_inputs(load_inputs(path, model, plan, false), in);
  // An indexer layer needs index_k.
  const std::string msg = error_of([&] { load_inputs(path, model, plan, true); });
  EXPECT_NE(msg.find("'index_k' is missing"), std::string::npos) << msg;
}

TEST(InputsFile, Bf16AndF32WeightsAreAccepted) {
  TempDir dir;
  const ModelConfig model = preset("glm-5");
  const PcpPlan plan = make_plan(batch(2));
  GlobalInputs in = generate_inputs(model, plan, true, 13);
  // Round the weights to bf16 so the BF16 file holds them exactly.
  for (auto* w : {&in.weights.q_norm_w, &in.weights.kv_norm_w, &in.weights.index_ln_w, &in.weights.index_ln_b}) {
    for (float& x : *w) x = codec::bf16_to_float(codec::float_to_bf16(x));
  }
  auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<uint16_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = codec::float_to_bf16(v[i]);
    return out;
  };
  const auto qw = to_bf16(in.weights.q_norm_w), kw = to_bf16(in.weights.kv_norm_w);
  const int64_t n = in.num_tokens;
  SafetensorsWriter w;
  w.add("q_c", StDtype::kBF16, {n, 2048}, in.q_c);
  w.add("kv", StDtype::kBF16, {n, 512}, in.kv);
  w.add("k_pe", StDtype::kBF16, {n, 64}, in.k_pe);
  w.add("index_k", StDtype::kBF16, {n, 128}, in.index_k);
  w.add("positions", StDtype::kI64, {n}, in.positions);
  w.add("q_norm_w", StDtype::kBF16, {2048}, qw);
  w.add("kv_norm_w", StDtype::kBF16, {512}, kw);
  w.add("index_ln_w", StDtype::kF32, {128}, in.weights.index_ln_w);
  std::vector<int64_t> wrong(128, 1);
  w.add("index_ln_b", StDtype::kI64, {128}, wrong);
  const std::string path = dir.file("w.safetensors");
  w.write(path);
  const std::string msg = error_of([&] { load_inputs(path, model, plan, true); });
  EXPECT_NE(msg.find("tensor 'index_ln_b'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected BF16 or F32 [128], got I64 [128]"), std::string::npos) << msg;

  SafetensorsWriter w2;
  w2.add("q_c", StDtype::kBF16, {n, 2048}, in.q_c);
  w2.add("kv", StDtype::kBF16, {n, 512}, in.kv);
  w2.add("k_pe", StDtype::kBF16, {n, 64}, in.k_pe);
  w2.add("index_k", StDtype::kBF16, {n, 128}, in.index_k);
  w2.add("positions", StDtype::kI64, {n}, in.positions);
  w2.add("q_norm_w", StDtype::kBF16, {2048}, qw);
  w2.add("kv_norm_w", StDtype::kBF16, {512}, kw);
  w2.add("index_ln_w", StDtype::kF32, {128}, in.weights.index_ln_w);
  w2.add("index_ln_b", StDtype::kF32, {128}, in.weights.index_ln_b);
  w2.write(path);
  const InputsBatch b = read_inputs_batch(path);
  EXPECT_TRUE(b.requests.empty()) << "no 'requests' tensor: the CLI's flags describe the batch";
  EXPECT_TRUE(b.slot_mapping.empty());
  expect_same_inputs(load_inputs(path, model, plan, true), in);
}

TEST(InputsFile, ApplySlotMappingRewritesEveryRank) {
  const PcpPlan base = make_plan(batch(4));
  // A captured mapping: the plan's slots, reversed (every slot still distinct and valid).
  std::vector<int64_t> slots = base.global_slots;
  std::reverse(slots.begin(), slots.end());
  PcpPlan plan = base;
  apply_slot_mapping(plan, slots, "test");
  EXPECT_NO_THROW(validate_plan(plan));
  EXPECT_EQ(plan.global_slots, slots);
  for (int32_t r = 0; r < plan.pcp_world; ++r) {
    const RankPlan& rp = plan.ranks[r];
    for (size_t i = 0; i < rp.global_index.size(); ++i) {
      const int64_t g = rp.global_index[i];
      const int64_t want = g < 0                                                                           ? -1
                           : (plan.requests[plan.global_request[g]].kind == RequestKind::kDecode && r > 0) ? -1
                                                                                                           : slots[g];
      EXPECT_EQ(rp.slot_mapping[i], want) << "rank " << r << " row " << i;
      EXPECT_EQ(plan.gathered_slot_mapping[r * plan.max_local_tokens + i], want);
    }
  }
  // Bad mappings are refused before the plan changes.
  for (auto [idx, value, expect] : std::vector<std::tuple<int, int64_t, std::string>>{
           {4, base.num_slots(), "out of range"}, {6, slots[2], "duplicates"}, {7, 0, "null block"}, {8, -1, "-1"}}) {
    std::vector<int64_t> bad = slots;
    bad[idx] = value;
    PcpPlan p = base;
    const std::string msg = error_of([&] { apply_slot_mapping(p, bad, "in.safetensors"); });
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
    EXPECT_NE(msg.find(fmt::format("slot_mapping[{}]", idx)), std::string::npos) << msg;
    EXPECT_EQ(p.global_slots, base.global_slots);
  }
  PcpPlan p = base;
  slots.pop_back();
  EXPECT_NE(error_of([&] { apply_slot_mapping(p, slots, "x"); }).find("entries"), std::string::npos);
}
