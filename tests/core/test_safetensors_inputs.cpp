// pcpkv-test-labels: unit
// Inputs files (inputs_io.h, load_inputs of inputs.h): save_run -> load_inputs round trips bit for bit,
// BF16 or F32 norm weights, the optional requests / slot_mapping tensors, apply_slot_mapping, and the
// cache regions save_run cuts out of an allocation (dense and padded geometries).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <tuple>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/inputs_io.h"
#include "pcpkv/publish/save_run.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/core/safetensors.h"
#include "support/error_of.h"

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

using pcpkv::test::error_of;

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
    if (!v.empty()) std::memcpy(out.data(), v.data(), v.size() * 4);  // data() may be null when empty (UB)
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

// slot == block_tables[request][pos / B] * B + pos % B for every token of the plan; returns the failures.
int64_t count_table_mismatches(const PcpPlan& plan) {
  int64_t bad = 0;
  const int64_t B = plan.block_size;
  for (int64_t g = 0; g < plan.num_global_tokens(); ++g) {
    const int64_t pos = plan.global_positions[g];
    const auto& table = plan.block_tables[plan.global_request[g]];
    const auto k = static_cast<size_t>(pos / B);
    bad += k >= table.size() || plan.global_slots[g] != int64_t{table[k]} * B + pos % B;
  }
  return bad;
}

// A captured mapping of another paged cache: the plan's blocks permuted (whole blocks move, offsets stay).
std::vector<int64_t> block_permuted_slots(const PcpPlan& plan, uint64_t seed) {
  std::vector<int64_t> ids(static_cast<size_t>(plan.num_blocks - 1));
  std::iota(ids.begin(), ids.end(), int64_t{1});
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  std::vector<int64_t> slots = plan.global_slots;
  const int64_t B = plan.block_size;
  for (int64_t& s : slots) s = ids[static_cast<size_t>(s / B - 1)] * B + s % B;
  return slots;
}

TEST(InputsFile, ApplySlotMappingRewritesEveryRank) {
  const PcpPlan base = make_plan(batch(4));
  ASSERT_EQ(count_table_mismatches(base), 0);
  const std::vector<int64_t> slots = block_permuted_slots(base, 9);
  ASSERT_NE(slots, base.global_slots);
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
  std::vector<int64_t> short_slots = slots;
  short_slots.pop_back();
  EXPECT_NE(error_of([&] { apply_slot_mapping(p, short_slots, "x"); }).find("entries"), std::string::npos);
}

// The block tables follow the slots actually used, so a --save after --inputs cannot contradict itself.
TEST(InputsFile, ApplySlotMappingDerivesConsistentBlockTables) {
  for (int32_t pcp : {1, 3, 4}) {
    const PcpPlan base = make_plan(batch(pcp));
    PcpPlan plan = base;
    apply_slot_mapping(plan, block_permuted_slots(base, 100 + pcp), "test");
    EXPECT_EQ(count_table_mismatches(plan), 0) << "pcp " << pcp;
    // Every table has the request's length, ids distinct, never the null block.
    std::vector<int32_t> all;
    for (size_t r = 0; r < plan.requests.size(); ++r) {
      EXPECT_EQ(plan.block_tables[r].size(), base.block_tables[r].size());
      all.insert(all.end(), plan.block_tables[r].begin(), plan.block_tables[r].end());
    }
    std::sort(all.begin(), all.end());
    EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end());
    EXPECT_GE(all.front(), 1);
    EXPECT_LT(all.back(), plan.num_blocks);
  }
  // The plan's own slots keep the plan's tables.
  PcpPlan same = make_plan(batch(2));
  const auto tables = same.block_tables;
  apply_slot_mapping(same, same.global_slots, "test");
  EXPECT_EQ(same.block_tables, tables);

  // A mapping no block table can produce is refused, naming the token, before the plan changes.
  const PcpPlan base = make_plan(batch(2));
  std::vector<int64_t> reversed = base.global_slots;
  std::reverse(reversed.begin(), reversed.end());
  PcpPlan p = base;
  std::string msg = error_of([&] { apply_slot_mapping(p, reversed, "in.safetensors"); });
  // Token 0 gets the last token's slot, which lies at offset 0 by chance: token 1 is the first wrong one.
  EXPECT_NE(msg.find("in.safetensors: slot_mapping[1] = "), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not follow a block table"), std::string::npos) << msg;
  EXPECT_EQ(p.global_slots, base.global_slots);
  EXPECT_EQ(p.block_tables, base.block_tables);
  // Two tokens of one logical block in different cache blocks.
  std::vector<int64_t> split = base.global_slots;
  std::swap(split[1], split[17]);  // positions 1 and 17 of request 0: same offset, logical blocks 0 and 1
  msg = error_of([&] { apply_slot_mapping(p, split, "in.safetensors"); });
  EXPECT_NE(msg.find("slot_mapping[1]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("positions 0..15"), std::string::npos) << msg;
}

TEST(InputsFile, BlockTablesRoundTripThroughSaveRun) {
  TempDir dir;
  const ModelConfig model = preset("glm-5");
  const PcpPlan base = make_plan(batch(3));
  PcpPlan plan = base;
  apply_slot_mapping(plan, block_permuted_slots(base, 4), "test");
  const GlobalInputs in = generate_inputs(model, plan, true, 11);
  const CacheFormat fmt;
  const std::string path = dir.file("run.safetensors");
  save_run(path, model, plan, fmt, in, fake_result(plan, fmt, 0, 0), SaveInfo{"direct", {}});

  const InputsBatch b = read_inputs_batch(path);
  ASSERT_EQ(b.block_tables.size(), plan.block_tables.size());
  // A fresh plan over the file's requests (other seed: other tables), then the file's tables.
  PlanConfig pc = batch(2);
  pc.seed = 77;
  pc.requests = b.requests;
  PcpPlan loaded = make_plan(pc);
  ASSERT_NE(loaded.block_tables, plan.block_tables);
  apply_block_tables(loaded, b.block_tables, "run.safetensors");
  EXPECT_NO_THROW(validate_plan(loaded));
  EXPECT_EQ(loaded.block_tables, plan.block_tables);
  EXPECT_EQ(loaded.global_slots, b.slot_mapping);
  EXPECT_EQ(count_table_mismatches(loaded), 0);

  // Bad tables are refused before the plan changes, naming the entry.
  auto refused = [&](std::vector<std::vector<int32_t>> t, const std::string& expect) {
    PcpPlan q = make_plan(pc);
    const auto before = q.block_tables;
    const std::string msg = error_of([&] { apply_block_tables(q, t, "f"); });
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
    EXPECT_EQ(q.block_tables, before);
  };
  auto t = b.block_tables;
  t[0][1] = 0;
  refused(t, "block_tables[0][1] = 0 is out of range");
  t = b.block_tables;
  t[2][0] = t[0][0];
  refused(t, "duplicates block_tables[0][0]");
  t = b.block_tables;
  t.pop_back();
  refused(t, "2 rows");
  t = b.block_tables;
  ASSERT_GT(t[1].size(), plan.block_tables[1].size());  // the decode's row is padded to the longest
  t[1].back() = 5;
  refused(t, "block_tables[1][4] = 5");
}
