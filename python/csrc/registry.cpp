// python/csrc/registry.cpp: every schema of the `pcpkv` and `pcpkv_vllm` torch libraries, and nothing else. Each op's
// implementations are in the file of its name (dispatch.cpp, combine.cpp, ..., vllm_dropin.cpp); the ops with a CPU and
// a CUDA implementation map the schema's arguments onto one struct by name there (binding.h). Mutated tensors are
// marked Tensor(a!). The fake (meta) kernels for torch.compile are Python (pcpkv_torch/_fake.py, vllm.py); the
// docstrings are pcpkv_torch/ops.py, consumers.py, tables.py, plan.py, transport.py, distributed.py and vllm.py.
#include <Python.h>

#include <torch/library.h>

// An importable module, so that `import pcpkv_torch._C` loads this library (and its registrations)
// without pybind11: everything is reached through torch.ops.pcpkv.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(pcpkv, m) {
  // ---- host-only setup ops (rope_table.cpp, replica_hash.cpp, tables.cpp, plan.cpp, transport.cpp)
  m.def("rope_table(int num_positions, str scaling, float theta, float factor, int original_max_position_embeddings, "
        "float beta_fast, float beta_slow, float mscale, float mscale_all_dim) -> Tensor");
  m.def("replica_hash_weights(int n) -> Tensor");
  m.def("first_overlap(Tensor[] writes, Tensor[] reads, bool writes_pairwise) -> int[]");
  m.def("first_range_overlap(Tensor ptrs, int[] sizes) -> int[]");
  m.def("make_plan(int pcp_world, int block_size, int[] is_decode, int[] num_new_tokens, int[] context_lens, "
        "int extra_blocks, bool reserve_null_block, bool shuffle_blocks, int seed, str local_order=\"request\", "
        "str decode_ownership=\"replicated\") -> (Tensor positions, "
        "Tensor slot_mapping, Tensor global_index, Tensor rank_counts, Tensor gathered_slot_mapping, "
        "Tensor global_positions, Tensor global_slots, Tensor global_request, Tensor block_tables, int num_blocks, "
        "Tensor decode_owner)");
  m.def("block_size_problem(int block_size) -> str");
  m.def("choose_transport(str[] hosts, Tensor peer_access, bool nccl_available) -> (str transport, str reason)");
  m.def("make_cache_targets(Tensor mla_ptrs, Tensor index_ptrs, int num_blocks, int block_size, int row_stride, "
        "int block_stride, int index_block_stride, str kv_format, bool has_indexer, int index_num_blocks=-1) "
        "-> Tensor");

  // ---- the publication (dispatch.cpp, combine.cpp, insert.cpp, fence.cpp)
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
#ifdef PCPKV_TORCH_CUDA
  m.def("cuda_dispatch_impl() -> str");  // only in CUDA builds: pcpkv_torch.cuda_dispatch_impl tells them apart
#endif

  // ---- the consumers (quantize_index_q.cpp, indexer_topk.cpp, sparse_mla.cpp, lse_merge.cpp)
  m.def("quantize_index_q(Tensor q, Tensor(a!) q_fp8, Tensor(b!) q_scale) -> ()");
  // The ATen form of the same quantizer (the CUDA implementation), on any device: tests hold it to the oracle.
  m.def("quantize_index_q_aten(Tensor q, Tensor(a!) q_fp8, Tensor(b!) q_scale) -> ()");
  m.def("indexer_topk(Tensor q_fp8, Tensor q_scale, Tensor weights, Tensor positions, Tensor request_idx, "
        "Tensor block_tables, Tensor index_cache, Tensor(a!) out, Tensor(b!)? positions_out, int topk, "
        "int? max_keys, str logit) -> ()");
  m.def("sparse_mla(Tensor q, Tensor mla_cache, Tensor indices, Tensor(a!) out, Tensor(b!) lse, str kv_format, "
        "str ds_mla_scale, float k_scale, float softmax_scale, str scale_read, str kernel) -> ()");
  m.def("lse_merge(Tensor outs, Tensor lses, Tensor(a!) out, Tensor(b!) lse) -> ()");

  // ---- pcpkv's rendezvous and symmetric memory (bootstrap.cpp, symmetric.cpp; the classes Bootstrap and
  // SymmetricBuffer are registered there)
  m.def("make_job_token() -> str");
  m.def("resource_counts() -> int[]");
  // Test hook: the allocation on group rank `group_rank` fails to map its peers with reason `why` (-1: off).
  m.def("set_symmetric_failure_for_test(int group_rank, str why, str device_type) -> ()");
}

// The vLLM drop-in (vllm_dropin.cpp).
TORCH_LIBRARY(pcpkv_vllm, m) {
  m.def("fused_norm_rope(Tensor positions, Tensor q_c, Tensor q_rms_norm_w, float q_rms_eps, Tensor kv_c, "
        "Tensor kv_rms_norm_w, float kv_rms_eps, Tensor k_pe, Tensor k_rope_cos_sin_cache, Tensor? index_k, "
        "Tensor? index_k_layer_norm_w, Tensor? index_k_layer_norm_bias, float index_k_layer_norm_eps, "
        "Tensor? index_k_rope_cos_sin_cache, Tensor(a!) topk_indices_buffer, Tensor? slot_mapping, "
        "Tensor(b!)? indexer_k_cache, Tensor(c!)? mla_kv_cache, str mla_kv_cache_dtype, Tensor? mla_k_scale, "
        "float mla_k_scale_value, bool has_indexer, bool index_rope_interleave, Tensor(d!) q_c_out, "
        "Tensor(e!)? kv_c_out, Tensor(f!)? k_pe_out, Tensor(g!)? index_k_out, Tensor? indexer_slot_mapping, "
        "str ds_mla_scale) -> ()");
}
