// python/csrc/ops.cpp: the `pcpkv` torch library: schemas (TORCH_LIBRARY), the host-only setup ops
// (rope_table, make_plan, make_cache_targets) and the CPU implementations, which call pcpkv's CPU reference
// (pcpkv/publish/cpu.h) on host memory. The CUDA implementations (ops_cuda.cpp) call pcpkv's launchers
// (pcpkv/publish/kernels.h); fake (meta) kernels for torch.compile are registered in Python (pcpkv_torch/_fake.py).
// Docstrings: pcpkv_torch/ops.py.
#include <Python.h>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/device/fence_kernel.h"
#include "pcpkv/device/replica_hash.h"
#include "pcpkv/core/interrupt.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/core/rope.h"
#include "pcpkv/publish/transport_choice.h"

// An importable module, so that `import pcpkv_torch._C` loads this library (and its registrations)
// without pybind11: everything is reached through torch.ops.pcpkv.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

namespace pcpkv_torch {
namespace {

int cpu_threads() { return std::max(1, std::min(at::get_num_threads(), 16)); }

// ---- host-only setup ops ----------------------------------------------------------------------------

// A rope table holds one 256-byte row per position. Real models use <= 2^20 positions; 2^28 (64 GiB) is a
// bound that refuses a mistyped count with a message instead of std::bad_alloc.
constexpr int64_t kMaxRopeTablePositions = int64_t{1} << 28;
constexpr int64_t kRopeTableRowBytes = pcpkv::kRopeDim * static_cast<int64_t>(sizeof(float));

at::Tensor rope_table(int64_t num_positions, c10::string_view scaling, double theta, double factor,
                      int64_t original_max_position_embeddings, double beta_fast, double beta_slow, double mscale,
                      double mscale_all_dim) {
  pcpkv::RopeConfig c;
  const std::string s(scaling);
  TORCH_CHECK_VALUE(s == "default" || s == "deepseek_yarn" || s == "yarn",
                    "rope_table: scaling = '", s, "'; expected 'default' or 'deepseek_yarn'");
  c.scaling = s == "default" ? pcpkv::RopeScaling::kDefault : pcpkv::RopeScaling::kDeepseekYarn;
  c.theta = theta;
  c.factor = factor;
  c.original_max_position_embeddings = original_max_position_embeddings;
  c.beta_fast = beta_fast;
  c.beta_slow = beta_slow;
  c.mscale = mscale;
  c.mscale_all_dim = mscale_all_dim;
  // (num_positions < 1 is refused by make_rope_table: test_errors.py checks that pcpkv::Error path.)
  TORCH_CHECK_VALUE(num_positions <= kMaxRopeTablePositions, "rope_table: num_positions = ", num_positions,
                    " exceeds 2^28 (", kRopeTableRowBytes, " B of host memory per position)");
  // theta <= 0 or a NaN factor would give NaN rows, not an error (pcpkv::validate_rope names the value).
  translate_errors([&] { pcpkv::validate_rope(c, "rope_table", ""); });
  const pcpkv::RopeTable t = translate_errors([&] {
    try {
      return pcpkv::make_rope_table(c, num_positions);
    } catch (const std::bad_alloc&) {
      PCPKV_FAIL("rope_table: num_positions = {} needs {} B of host memory, which could not be allocated", num_positions,
                 num_positions * kRopeTableRowBytes);
    }
  });
  at::Tensor out = at::empty({t.num_positions, pcpkv::kRopeDim}, at::kFloat);
  std::memcpy(out.data_ptr(), t.cos_sin.data(), t.cos_sin.size() * sizeof(float));
  return out;
}

template <class T>
at::Tensor to_tensor(const std::vector<T>& v, at::ScalarType dtype = at::kLong) {
  at::Tensor out = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<int64_t>(v[i]);
  return dtype == at::kLong ? out : out.to(dtype);
}

using PlanTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                             at::Tensor, at::Tensor, int64_t, at::Tensor>;

PlanTuple make_plan(int64_t pcp_world, int64_t block_size, at::IntArrayRef is_decode, at::IntArrayRef num_new_tokens,
                    at::IntArrayRef context_lens, int64_t extra_blocks, bool reserve_null_block, bool shuffle_blocks,
                    int64_t seed, c10::string_view local_order, c10::string_view decode_ownership) {
  TORCH_CHECK_VALUE(is_decode.size() == num_new_tokens.size() && context_lens.size() == num_new_tokens.size(),
                    "make_plan: is_decode (", is_decode.size(), "), num_new_tokens (", num_new_tokens.size(),
                    ") and context_lens (", context_lens.size(), ") must have one entry per request");
  // PlanConfig holds them as int32: checked before the cast (2^32 + 2 ranks was a plan of 2 that said 2^32 + 2).
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"pcp_world", pcp_world}, {"block_size", block_size}})
    TORCH_CHECK_VALUE(v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
                      "make_plan: ", name, " = ", v, " is out of the int32 range of a plan");
  pcpkv::PlanConfig cfg;
  cfg.pcp_world = static_cast<int32_t>(pcp_world);
  cfg.block_size = static_cast<int32_t>(block_size);
  cfg.extra_blocks = extra_blocks;
  cfg.reserve_null_block = reserve_null_block;
  cfg.shuffle_blocks = shuffle_blocks;
  cfg.seed = static_cast<uint64_t>(seed);
  translate_errors([&] {
    cfg.local_order = pcpkv::parse_local_order(std::string(local_order), "local_order");
    cfg.decode_ownership = pcpkv::parse_decode_ownership(std::string(decode_ownership), "decode_ownership");
  });
  for (size_t i = 0; i < num_new_tokens.size(); ++i) {
    pcpkv::RequestSpec r;
    r.kind = is_decode[i] ? pcpkv::RequestKind::kDecode : pcpkv::RequestKind::kPrefill;
    r.num_new_tokens = num_new_tokens[i];
    r.context_len = context_lens[i];
    cfg.requests.push_back(r);
  }
  const pcpkv::PcpPlan plan = translate_errors([&] { return pcpkv::make_plan(cfg); });
  const int64_t P = plan.pcp_world, M = plan.max_local_tokens;
  at::Tensor positions = at::empty({P, M}, at::kLong), slots = at::empty({P, M}, at::kLong),
             global_index = at::empty({P, M}, at::kLong), counts = at::empty({P, 3}, at::kLong);
  for (int64_t r = 0; r < P; ++r) {
    const pcpkv::RankPlan& rp = plan.ranks[static_cast<size_t>(r)];
    std::memcpy(positions[r].data_ptr(), rp.positions.data(), static_cast<size_t>(M) * 8);
    std::memcpy(slots[r].data_ptr(), rp.slot_mapping.data(), static_cast<size_t>(M) * 8);
    std::memcpy(global_index[r].data_ptr(), rp.global_index.data(), static_cast<size_t>(M) * 8);
    int64_t* c = counts[r].data_ptr<int64_t>();
    c[0] = rp.num_local_tokens;
    c[1] = rp.num_prefill_tokens;
    c[2] = rp.num_decode_tokens;
  }
  size_t max_blocks = 0;
  for (const auto& bt : plan.block_tables) max_blocks = std::max(max_blocks, bt.size());
  at::Tensor tables = at::full({static_cast<int64_t>(plan.block_tables.size()), static_cast<int64_t>(max_blocks)}, -1,
                               at::kInt);
  for (size_t i = 0; i < plan.block_tables.size(); ++i)
    std::copy(plan.block_tables[i].begin(), plan.block_tables[i].end(),
              tables[static_cast<int64_t>(i)].data_ptr<int32_t>());
  return {positions,
          slots,
          global_index,
          counts,
          to_tensor(plan.gathered_slot_mapping),
          to_tensor(plan.global_positions),
          to_tensor(plan.global_slots),
          to_tensor(plan.global_request),
          tables,
          plan.num_blocks,
          to_tensor(plan.decode_owner)};
}

at::Tensor make_cache_targets(const at::Tensor& mla_ptrs, const at::Tensor& index_ptrs, int64_t num_blocks,
                              int64_t block_size, int64_t row_stride, int64_t block_stride, int64_t index_block_stride,
                              c10::string_view kv_format, bool has_indexer, int64_t index_num_blocks) {
  const pcpkv::CacheFormat fmt = make_format(std::string(kv_format), "pow2", 1.0, has_indexer);
  const std::vector<uint8_t*> mla = read_pointer_table(mla_ptrs, "make_cache_targets: mla_ptrs");
  const std::vector<uint8_t*> idx = read_pointer_table(index_ptrs, "make_cache_targets: index_ptrs");
  TORCH_CHECK_VALUE(!mla.empty(), "make_cache_targets: mla_ptrs is empty; expected one pointer per replica");
  TORCH_CHECK_VALUE(!has_indexer || idx.size() == mla.size(), "make_cache_targets: ", mla.size(),
                    " MLA pointers but ", idx.size(), " indexer pointers");
  at::Tensor out = at::zeros({static_cast<int64_t>(mla.size()), kTargetRecordBytes}, at::kByte);
  auto* rec = reinterpret_cast<pcpkv::CacheTarget*>(out.data_ptr());
  translate_errors([&] {
    for (size_t d = 0; d < mla.size(); ++d) {
      pcpkv::CacheTarget t;
      t.mla_base = mla[d];
      t.mla.num_blocks = num_blocks;
      t.mla.block_size = static_cast<int32_t>(block_size);
      t.mla.row_stride = row_stride;
      t.mla.block_stride = block_stride;
      if (has_indexer) {
        t.index_base = idx[d];
        t.index.num_blocks = index_num_blocks < 0 ? num_blocks : index_num_blocks;  // its own (spec 4.2), or the MLA's
        t.index.block_size = static_cast<int32_t>(block_size);
        t.index.block_stride = index_block_stride;
      }
      pcpkv::validate_cache_target(t, fmt, fmt::format("make_cache_targets: target {}", d).c_str());
      rec[d] = t;
    }
  });
  return out;
}

// ---- CPU implementations ------------------------------------------------------------------------------

template <class T>
bool same_records(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

void dispatch_cpu(const at::Tensor& kv, const at::Tensor& k_pe, const at::Tensor& positions,
                  const at::Tensor& kv_norm_w, const at::Tensor& rope_cos_sin, const std::optional<at::Tensor>& q_c,
                  const std::optional<at::Tensor>& q_norm_w, const std::optional<at::Tensor>& index_k,
                  const std::optional<at::Tensor>& index_ln_w, const std::optional<at::Tensor>& index_ln_b,
                  const std::optional<at::Tensor>& slot_mapping, const std::optional<at::Tensor>& targets,
                  const std::optional<at::Tensor>& targets_host, const std::optional<at::Tensor>& row_dests,
                  const std::optional<at::Tensor>& row_dests_host, const std::optional<at::Tensor>& q_c_out,
                  const std::optional<at::Tensor>& kv_c_out, const std::optional<at::Tensor>& k_pe_out,
                  const std::optional<at::Tensor>& index_k_out, const std::optional<at::Tensor>& topk_fill,
                  at::TensorList written, c10::string_view kv_format, c10::string_view ds_mla_scale,
                  double k_scale, bool has_indexer, double q_eps, double kv_eps, double index_eps,
                  bool mla_rope_interleaved, bool index_rope_interleaved, bool index_hadamard,
                  c10::string_view topk_fill_mode, int64_t topk_indexer_rows,
                  const std::optional<at::Tensor>& indexer_slot_mapping) {
  DispatchArgs a{kv,          k_pe,     positions, kv_norm_w, rope_cos_sin, q_c,
                 q_norm_w,    index_k,  index_ln_w, index_ln_b, slot_mapping, q_c_out,
                 kv_c_out,    k_pe_out, index_k_out, topk_fill, std::string(kv_format), std::string(ds_mla_scale),
                 k_scale,     has_indexer, q_eps,   kv_eps,    index_eps,    mla_rope_interleaved,
                 index_rope_interleaved, index_hadamard};
  a.topk_fill_mode = std::string(topk_fill_mode);
  a.topk_indexer_rows = topk_indexer_rows;
  a.indexer_slot_mapping = indexer_slot_mapping;
  a.tables = {targets.value_or(at::Tensor()), targets_host.value_or(at::Tensor()), row_dests.value_or(at::Tensor()),
              row_dests_host.value_or(at::Tensor())};
  a.written = written.vec();
  pcpkv::DispatchParams p = make_dispatch_params(a);
  std::vector<pcpkv::CacheTarget> tv;
  std::vector<uint8_t*> dv;
  // On the CPU the "device" table is a host table; its host copy, when given, must hold the same entries
  // (the CUDA op validates the host copy and launches on the device one).
  if (has(targets)) {
    tv = read_target_table(*targets, "dispatch: targets");
    check_uniform_targets(tv, has_indexer, "dispatch: targets");
    if (has(targets_host))
      TORCH_CHECK_VALUE(same_records(read_target_table(*targets_host, "dispatch: targets_host"), tv),
                        "dispatch: targets (", describe(*targets), ") differs from targets_host (",
                        describe(*targets_host), ")");
    p.targets = tv.data();
    p.num_targets = static_cast<int32_t>(tv.size());
  }
  if (has(row_dests)) {
    dv = read_pointer_table(*row_dests, "dispatch: row_dests");
    if (has(row_dests_host))
      TORCH_CHECK_VALUE(same_records(read_pointer_table(*row_dests_host, "dispatch: row_dests_host"), dv),
                        "dispatch: row_dests (", describe(*row_dests), ") differs from row_dests_host (",
                        describe(*row_dests_host), ")");
    p.row_dests = dv.data();
    p.num_row_dests = static_cast<int32_t>(dv.size());
    p.row_bytes = pcpkv::transport_row_layout(p.fmt).row_bytes;
  }
  translate_errors([&] { pcpkv::dispatch_reference(p, cpu_threads()); });
}

void combine_cpu(const at::Tensor& rows, const at::Tensor& slot_mapping, const at::Tensor& mla_cache,
                 const std::optional<at::Tensor>& index_cache, c10::string_view kv_format,
                 c10::string_view ds_mla_scale, double k_scale, bool has_indexer,
                 const std::optional<at::Tensor>& indexer_slot_mapping) {
  const pcpkv::CombineParams p = make_combine_params(rows, slot_mapping, mla_cache, index_cache, kv_format,
                                                     ds_mla_scale, k_scale, has_indexer, indexer_slot_mapping);
  translate_errors([&] { pcpkv::combine_reference(p, cpu_threads()); });
}

void insert_cpu(const at::Tensor& kv_c, const at::Tensor& k_pe, const std::optional<at::Tensor>& index_k,
                const at::Tensor& slot_mapping, const at::Tensor& mla_cache, const std::optional<at::Tensor>& index_cache,
                c10::string_view kv_format, c10::string_view ds_mla_scale, double k_scale,
                const std::optional<at::Tensor>& indexer_slot_mapping) {
  const pcpkv::InsertParams p = make_insert_params(kv_c, k_pe, index_k, slot_mapping, mla_cache, index_cache, kv_format,
                                                   ds_mla_scale, k_scale, indexer_slot_mapping);
  translate_errors([&] { pcpkv::insert_reference(p, cpu_threads()); });
}

// The SPEC section 5 fence for the ranks [first_rank, first_rank + epochs.size(0)) hosted by this call, over
// host pads (the same protocol as pcpkv::HostFence and the device fence): arrive for every hosted rank,
// then wait for every hosted rank, so that one call may host all W ranks of a single process.
void fence_cpu(const at::Tensor& pad_table, const at::Tensor& epochs, const at::Tensor& claim, const at::Tensor& error,
               int64_t first_rank, int64_t world, int64_t num_barriers, int64_t barrier_idx, int64_t timeout_us,
               at::TensorList written) {
  // claim is the CUDA fence's (it elects the block that reports a timeout); here it must only be on the CPU.
  TORCH_CHECK_VALUE(claim.device().is_cpu(), "fence: claim is on ", claim.device(), " but epochs on cpu");
  check_written_devices("fence", written.vec(), "epochs", c10::Device(c10::kCPU));
  const std::vector<uint8_t*> pads = read_pointer_table(pad_table, "fence: pad_table");
  TORCH_CHECK_VALUE(static_cast<int64_t>(pads.size()) == world, "fence: pad_table has ", pads.size(),
                    " entries but world = ", world);
  TORCH_CHECK_VALUE(epochs.device().is_cpu() && epochs.scalar_type() == at::kLong && epochs.dim() == 2 &&
                        epochs.size(1) == num_barriers && epochs.is_contiguous(),
                    "fence: epochs: expected contiguous CPU int64 [num_local_ranks, num_barriers=", num_barriers,
                    "], got ", describe(epochs));
  const int64_t n = epochs.size(0);
  TORCH_CHECK_VALUE(first_rank >= 0 && n >= 1 && first_rank + n <= world, "fence: ranks [", first_rank, ", ",
                    first_rank + n, ") are not inside [0, world=", world, ")");
  TORCH_CHECK_VALUE(barrier_idx >= 0 && barrier_idx < num_barriers, "fence: barrier_idx = ", barrier_idx,
                    " is out of range [0, ", num_barriers, ")");
  TORCH_CHECK_VALUE(timeout_us > 0 && timeout_us <= kMaxFenceTimeoutUs, "fence: timeout_us = ", timeout_us,
                    " must be in [1, ", kMaxFenceTimeoutUs, "] (one day)");
  TORCH_CHECK_VALUE(error.device().is_cpu() && error.scalar_type() == at::kByte &&
                        error.numel() == static_cast<int64_t>(sizeof(pcpkv::FenceError)) && error.is_contiguous(),
                    "fence: error: expected a contiguous CPU uint8 [", sizeof(pcpkv::FenceError), "], got ",
                    describe(error));
  for (size_t r = 0; r < pads.size(); ++r)
    TORCH_CHECK_VALUE(pads[r] != nullptr && reinterpret_cast<uintptr_t>(pads[r]) % 8 == 0, "fence: pad_table[", r,
                      "] is null or not 8-byte aligned");
  auto slot = [&](int64_t owner, uint64_t parity, int64_t src) {
    auto* pad = reinterpret_cast<uint64_t*>(pads[static_cast<size_t>(owner)]);
    return std::atomic_ref<uint64_t>(pad[(barrier_idx * 2 + static_cast<int64_t>(parity)) * world + src]);
  };
  int64_t* ep = epochs.data_ptr<int64_t>();
  std::vector<uint64_t> e(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; ++b) {
    e[b] = static_cast<uint64_t>(ep[b * num_barriers + barrier_idx]) + 1;
    ep[b * num_barriers + barrier_idx] = static_cast<int64_t>(e[b]);
    for (int64_t peer = 0; peer < world; ++peer) slot(peer, e[b] & 1, first_rank + b).store(e[b], std::memory_order_release);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
  auto next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(pcpkv::kInterruptPollMs);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t me = first_rank + b;
    for (int64_t peer = 0; peer < world; ++peer) {
      uint32_t spins = 0;
      uint64_t v;
      while (static_cast<int64_t>((v = slot(me, e[b] & 1, peer).load(std::memory_order_acquire)) - e[b]) < 0) {
        if (++spins > 64) std::this_thread::yield();
        if ((spins & 1023u) == 0 && std::chrono::steady_clock::now() >= next_check) {
          pcpkv::check_interrupt();  // Ctrl-C: KeyboardInterrupt now, not at the timeout (bootstrap.cpp sets it)
          next_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(pcpkv::kInterruptPollMs);
        }
        if ((spins & 1023u) == 0 && std::chrono::steady_clock::now() > deadline) {
          pcpkv::FenceError err;
          err.flag = pcpkv::kFenceErrorFlag;
          err.waiting_rank = static_cast<int32_t>(me);
          err.missing_rank = static_cast<int32_t>(peer);
          err.barrier_idx = static_cast<int32_t>(barrier_idx);
          err.epoch = e[b];
          err.seen = v;
          std::memcpy(error.data_ptr(), &err, sizeof(err));
          translate_errors([&]() -> int {
            throw pcpkv::FenceTimeout(fmt::format("fence: rank {} waited {} us at barrier {} for epoch {}, rank {} "
                                                  "never arrived (its slot holds {})",
                                                  me, timeout_us, barrier_idx, e[b], peer, v),
                                      static_cast<int>(peer));
          });
        }
      }
    }
  }
}

}  // namespace

// transport "auto" (pcpkv::choose_transport): the decision stays in one C++ function for the CLI and Python.
std::tuple<std::string, std::string> choose_transport(std::vector<std::string> hosts, const at::Tensor& peer_access,
                                                      bool nccl_available) {
  const auto P = static_cast<int64_t>(hosts.size());
  TORCH_CHECK_VALUE(peer_access.dim() == 2 && peer_access.size(0) == P && peer_access.size(1) == P,
                    "choose_transport: peer_access must be [", P, ", ", P, "] (one row per host entry), got ",
                    describe(peer_access));
  const at::Tensor a = peer_access.to(at::kCPU).to(at::kBool).contiguous();
  pcpkv::Topology t;
  t.hosts = std::move(hosts);
  t.nccl_available = nccl_available;
  const bool* p = a.data_ptr<bool>();
  for (int64_t r = 0; r < P; ++r) t.peer_access.emplace_back(p + r * P, p + (r + 1) * P);
  const pcpkv::TransportChoice c = translate_errors([&] { return pcpkv::choose_transport(t); });
  return {pcpkv::to_string(c.transport), c.reason};
}

// w(0..n) of the replica hash (docs/spec.md 5.2) as int64 (two's complement of the uint64 weights): the one
// definition, pcpkv/device/replica_hash.h, for pcpkv_torch.models.replica_check.
at::Tensor replica_hash_weights(int64_t n) {
  TORCH_CHECK_VALUE(n >= 0 && n <= pcpkv::hash::kMaxHashedBytes, "replica_hash_weights: n = ", n, " must be in [0, ",
                    pcpkv::hash::kMaxHashedBytes, "]");
  at::Tensor w = at::empty({n}, at::kLong);
  int64_t* p = w.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) p[j] = static_cast<int64_t>(pcpkv::hash::replica_hash_weight(static_cast<uint64_t>(j)));
  return w;
}

static std::vector<int64_t> as_list(const std::optional<std::pair<size_t, size_t>>& hit) {
  if (!hit) return {};
  return {static_cast<int64_t>(hit->first), static_cast<int64_t>(hit->second)};
}

// first_overlap (csrc/common.h, over pcpkv::first_overlap) for the Python entry points that name their own
// arguments: [] or [i, j].
std::vector<int64_t> first_overlap_op(at::TensorList writes, at::TensorList reads, bool writes_pairwise) {
  return as_list(first_overlap(writes.vec(), reads.vec(), writes_pairwise));
}

// first_overlap of the entries of one pointer table (Python's CacheTargets / RowDests constructors): entry i spans
// [ptrs[i], ptrs[i] + sizes[i]) of the table's one address space; every pair is compared. [] or [i, j].
std::vector<int64_t> first_range_overlap(const at::Tensor& ptrs, at::IntArrayRef sizes) {
  const std::vector<uint8_t*> p = read_pointer_table(ptrs, "first_range_overlap: ptrs");
  TORCH_CHECK_VALUE(sizes.size() == p.size(), "first_range_overlap: ", p.size(), " pointers but ", sizes.size(),
                    " sizes");
  std::vector<ByteRange> r(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    TORCH_CHECK_VALUE(sizes[i] >= 0, "first_range_overlap: sizes[", i, "] = ", sizes[i], " is negative");
    r[i] = pcpkv::byte_range(p[i], static_cast<uint64_t>(sizes[i]));  // saturated: it still covers its bytes
  }
  return as_list(pcpkv::first_overlap(r, {}, true));
}

TORCH_LIBRARY(pcpkv, m) {
  m.def("rope_table(int num_positions, str scaling, float theta, float factor, int original_max_position_embeddings, "
        "float beta_fast, float beta_slow, float mscale, float mscale_all_dim) -> Tensor",
        &rope_table);
  m.def("replica_hash_weights(int n) -> Tensor", &replica_hash_weights);
  m.def("first_overlap(Tensor[] writes, Tensor[] reads, bool writes_pairwise) -> int[]", &first_overlap_op);
  m.def("first_range_overlap(Tensor ptrs, int[] sizes) -> int[]", &first_range_overlap);
  m.def("make_plan(int pcp_world, int block_size, int[] is_decode, int[] num_new_tokens, int[] context_lens, "
        "int extra_blocks, bool reserve_null_block, bool shuffle_blocks, int seed, str local_order=\"request\", "
        "str decode_ownership=\"replicated\") -> (Tensor positions, "
        "Tensor slot_mapping, Tensor global_index, Tensor rank_counts, Tensor gathered_slot_mapping, "
        "Tensor global_positions, Tensor global_slots, Tensor global_request, Tensor block_tables, int num_blocks, "
        "Tensor decode_owner)",
        &make_plan);
  m.def("choose_transport(str[] hosts, Tensor peer_access, bool nccl_available) -> (str transport, str reason)",
        &choose_transport);
  m.def("make_cache_targets(Tensor mla_ptrs, Tensor index_ptrs, int num_blocks, int block_size, int row_stride, "
        "int block_stride, int index_block_stride, str kv_format, bool has_indexer, int index_num_blocks=-1) -> Tensor",
        &make_cache_targets);
  m.def("dispatch(Tensor kv, Tensor k_pe, Tensor positions, Tensor kv_norm_w, Tensor rope_cos_sin, "
        "Tensor? q_c, Tensor? q_norm_w, Tensor? index_k, Tensor? index_ln_w, Tensor? index_ln_b, "
        "Tensor? slot_mapping, Tensor? targets, Tensor? targets_host, Tensor? row_dests, Tensor? row_dests_host, "
        "Tensor(a!)? q_c_out, Tensor(b!)? kv_c_out, Tensor(c!)? k_pe_out, Tensor(d!)? index_k_out, "
        "Tensor(e!)? topk_fill, Tensor(f!)[] written, str kv_format, str ds_mla_scale, float k_scale, "
        "bool has_indexer, float q_eps, float kv_eps, float index_eps, bool mla_rope_interleaved, "
        "bool index_rope_interleaved, bool index_hadamard, str topk_fill_mode=\"full\", int topk_indexer_rows=0, "
        "Tensor? indexer_slot_mapping=None) -> ()");
  m.def("combine(Tensor rows, Tensor slot_mapping, Tensor(a!) mla_cache, Tensor(b!)? index_cache, str kv_format, "
        "str ds_mla_scale, float k_scale, bool has_indexer, Tensor? indexer_slot_mapping=None) -> ()");
  m.def("insert(Tensor kv_c, Tensor k_pe, Tensor? index_k, Tensor slot_mapping, Tensor(a!) mla_cache, "
        "Tensor(b!)? index_cache, str kv_format, str ds_mla_scale, float k_scale, "
        "Tensor? indexer_slot_mapping=None) -> ()");
  m.def("fence(Tensor pad_table, Tensor(a!) epochs, Tensor(b!) claim, Tensor(c!) error, int first_rank, int world, "
        "int num_barriers, int barrier_idx, int timeout_us, Tensor(d!)[] written) -> ()");
}

TORCH_LIBRARY_IMPL(pcpkv, CPU, m) {
  m.impl("dispatch", &dispatch_cpu);
  m.impl("combine", &combine_cpu);
  m.impl("insert", &insert_cpu);
  m.impl("fence", &fence_cpu);
}

}  // namespace pcpkv_torch
