// pcpkv/publish/cpu.h: the CPU reference kernels, one per contract of pcpkv/publish/dispatch.h (SPEC sections 2, 3, 5).
//
// These are THE oracle the CUDA kernels are checked against byte for byte. They compute in the canonical
// rounding order of pcpkv/device/token_math.h and convert only through pcpkv/device/codec.h (via the row
// encoders of pcpkv/device/pack.h). All pointers are host pointers.
//
// Every function validates its parameters first (null pointers, strides, slots in range and not repeated,
// positions in [0, rope_num_positions), geometry, k_scale) and throws pcpkv::Error naming the field and
// the value before it writes a single byte. num_threads > 1 splits the token range over that many threads;
// the bytes do not depend on it (every token is computed independently).
#pragma once

#include <cstdint>

#include "pcpkv/publish/dispatch.h"
#include "pcpkv/publish/validate.h"  // the checks each function runs first

namespace pcpkv {

/// Fused dispatch (SPEC section 2) of p.num_tokens tokens; see DispatchParams for the modes.
///  q_c_out   [T, q_lora_rank] bf16 = bf16(RMSNorm(q_c) * q_norm_w)
///  kv_c_out  [T, 512] bf16, k_pe_out [T, 64] bf16, index_k_out [T, 128] bf16: bf16 of the same fp32 values
///            the cache write quantizes (the "collect" materialization)
///  topk_fill [T, topk_width] int32 = -1
///  targets   every token with slot >= 0 writes its MLA row and (indexer layers) indexer slot into each target
///  row_dests every token t < T (padding included) writes its transport row at row_dests[d] + t * row_bytes;
///            the 12 pad bytes of an indexer row are written as zeros.
/// Throws pcpkv::Error (nothing written) on a bad parameter.
void dispatch_reference(const DispatchParams& p, int num_threads = 1);

/// Staging rows -> local caches (SPEC section 5, "staging"): row i of rows (i < num_src_ranks *
/// max_local_tokens) with slot_mapping[i] >= 0 is copied byte for byte: bytes [0, mla_bytes) to the MLA row
/// of that slot and, for indexer layers, the indexer data and scale to the indexer slot.
/// Throws pcpkv::Error (nothing written) on a bad parameter.
void combine_reference(const CombineParams& p, int num_threads = 1);

/// Collect path (SPEC section 5, "collect"): quantize-and-insert gathered bf16 rows. Token t with
/// slot_mapping[t] >= 0 is encoded from the fp32 values of its bf16 inputs (so collect bytes differ from
/// the fused path's, which quantizes fp32 registers). Throws pcpkv::Error (nothing written) on bad input.
void insert_reference(const InsertParams& p, int num_threads = 1);

}  // namespace pcpkv
