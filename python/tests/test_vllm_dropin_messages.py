"""The drop-in's refusals word for word: pcpkv_torch.vllm.fused_norm_rope's mapping moved from Python to one C++ op
(python/csrc/vllm_dropin.cpp, issue 35 item 4) with its errors unchanged. MESSAGES holds what the Python mapping
raised for every refused case of test_vllm_dropin.py (bad_cases, overlap_cases) and for EXTRA_CASES below, recorded
from it before the move (commit 6f34418); the C++ op must raise the same ValueError with the same text. The cases
test_vllm_dropin.internal_name_cases changed on purpose (issue 31 item 9) are not here."""

import pytest

from helpers import torch
from test_vllm_dropin import BLOCK_SIZE, NUM_BLOCKS, T, bad_cases, overlap_cases, vllm_inputs

from pcpkv_torch.vllm import fused_norm_rope


def extra_cases():
    """Argument overrides the two test_vllm_dropin lists do not try: the other branches of the mapping."""
    def meta(k):
        return lambda a: a[k].to("meta")

    return [
        dict(positions=lambda a: a["positions"].view(T, 1)),
        dict(q_c=lambda a: a["q_c"][0]),
        dict(positions=None),
        dict(q_c=3),
        dict(mla_kv_cache=[1, 2]),
        dict(mla_k_scale="0.5"),
        dict(mla_k_scale=lambda a: torch.tensor([0.5, 0.5])),
        dict(mla_k_scale=lambda a: torch.tensor([1], dtype=torch.int64)),
        dict(q_rms_eps=True),
        dict(kv_rms_eps="1e-5"),
        dict(mla_kv_cache_dtype=5),
        dict(has_indexer=None),
        dict(write_kv_output=1),
        dict(topk_indices_buffer=lambda a: a["topk_indices_buffer"][0]),
        dict(k_rope_cos_sin_cache=lambda a: a["k_rope_cos_sin_cache"].double().repeat(1, 2)[:, ::2]),
        dict(index_k_layer_norm_w=lambda a: a["index_k_layer_norm_w"].int()),
        dict(index_k_layer_norm_bias=lambda a: a["index_k_layer_norm_bias"][:64]),
        dict(index_k=lambda a: a["index_k"][:, :64]),
        dict(kv_c=lambda a: a["kv_c"].t().contiguous().t()),
        dict(indexer_k_cache=lambda a: a["indexer_k_cache"].int()),
        dict(indexer_k_cache=meta("indexer_k_cache")),
        dict(mla_kv_cache=meta("mla_kv_cache")),
        dict(index_k_rope_cos_sin_cache=meta("index_k_rope_cos_sin_cache")),
        dict(indexer_k_cache=None, index_k_out=lambda a: torch.zeros((T, 128), dtype=torch.bfloat16)),
        dict(slot_mapping=lambda a: a["slot_mapping"][:-1]),
        dict(slot_mapping=lambda a: a["slot_mapping"].clone().fill_(NUM_BLOCKS * BLOCK_SIZE)),
        dict(kv_c_out=lambda a: torch.zeros((T, 256), dtype=torch.bfloat16)),
        dict(q_c_out=lambda a: a["q_c_out"][:, :128]),
        dict(q_c_out=None, positions=lambda a: a["positions"].view(T, 1)),
        dict(q_c_out=None, q_c=lambda a: a["q_c"][0]),
    ]


# fmt: off
MESSAGES = [
    "ValueError: fused_norm_rope: mla_kv_cache_dtype: = 'fp8_e5m2'; pcpkv maps ['auto', 'fp8', "
    "'fp8_ds_mla', 'fp8_e4m3'] (vLLM would write e4m3 bytes for any other string)",
    "ValueError: fused_norm_rope: mla_kv_cache_dtype: = 'bfloat16'; pcpkv maps ['auto', 'fp8', "
    "'fp8_ds_mla', 'fp8_e4m3'] (vLLM would write e4m3 bytes for any other string)",
    'ValueError: fused_norm_rope: mla_kv_cache: expected torch.bfloat16 [num_blocks, block_size, 576] '
    "with unit inner stride for mla_kv_cache_dtype = 'auto', got torch.uint8 [6, 16, 656] strides "
    '[10496, 656, 1] on cpu',
    'ValueError: fused_norm_rope: q_c: expected bfloat16 [24 (positions), n] with unit inner stride on '
    "cpu (positions' device), got torch.float16 [24, 256] strides [256, 1] on cpu",
    'ValueError: fused_norm_rope: q_c: width q_lora_rank = 0 must be a multiple of 8 in [8, 4096] '
    "(pcpkv's dispatch), got torch.bfloat16 [24, 0] strides [1, 1] on cpu",
    'ValueError: fused_norm_rope: q_c: width q_lora_rank = 12 must be a multiple of 8 in [8, 4096] '
    "(pcpkv's dispatch), got torch.bfloat16 [24, 12] strides [12, 1] on cpu",
    'ValueError: fused_norm_rope: q_c: width q_lora_rank = 4104 must be a multiple of 8 in [8, 4096] '
    "(pcpkv's dispatch), got torch.bfloat16 [24, 4104] strides [4104, 1] on cpu",
    'ValueError: fused_norm_rope: kv_c: expected bfloat16 [24 (positions), 512] with unit inner stride '
    "on cpu (positions' device), got torch.bfloat16 [24, 256] strides [832, 1] on cpu",
    'ValueError: fused_norm_rope: k_pe: expected bfloat16 [24 (positions), 64] with unit inner stride on '
    "cpu (positions' device), got torch.bfloat16 [23, 64] strides [832, 1] on cpu",
    'ValueError: fused_norm_rope: positions: expected int64 [num_tokens], got torch.int32 [24] strides [1] on cpu',
    'ValueError: fused_norm_rope: q_rms_norm_w: expected a float [256] weight on cpu, got torch.bfloat16 '
    '[8] strides [1] on cpu',
    'ValueError: fused_norm_rope: k_rope_cos_sin_cache: expected a float [max_position, 64] cos/sin '
    "cache ([cos 32 | sin 32] per position; pcpkv's rotary dims are 64), got torch.bfloat16 [3000, 32] "
    'strides [64, 1] on cpu',
    'ValueError: fused_norm_rope: index_k_rope_cos_sin_cache: holds other values than '
    'k_rope_cos_sin_cache; pcpkv rotates k_pe and index_k with one table (the rotation style is '
    'index_rope_interleave)',
    'ValueError: fused_norm_rope: index_k_rope_cos_sin_cache: expected a float [max_position, 64] '
    "cos/sin cache ([cos 32 | sin 32] per position; pcpkv's rotary dims are 64)",
    'ValueError: fused_norm_rope: index_k: expected bfloat16 [24 (positions), 128] with unit inner '
    "stride on cpu (positions' device)",
    'ValueError: fused_norm_rope: topk_indices_buffer: expected int32 [>= 24, topk] on cpu whose first '
    '24 rows are contiguous, got torch.int32 [23, 64] strides [64, 1] on cpu',
    'ValueError: fused_norm_rope: topk_indices_buffer: expected int32 [>= 24, topk] on cpu whose first '
    '24 rows are contiguous, got torch.int64 [29, 64] strides [64, 1] on cpu',
    'ValueError: fused_norm_rope: topk_indices_buffer: expected int32 [>= 24, topk] on cpu whose first '
    '24 rows are contiguous, got torch.int32 [29, 32] strides [64, 2] on cpu',
    'ValueError: fused_norm_rope: q_c_out: expected a contiguous bfloat16 [24, 256] on cpu, got '
    'torch.bfloat16 [24, 256] strides [1, 24] on cpu',
    'ValueError: fused_norm_rope: slot_mapping: expected int64 [24] on cpu, got torch.int32 [24] strides '
    '[1] on cpu',
    "ValueError: fused_norm_rope: mla_kv_cache: is None but indexer_k_cache is given: pcpkv's cache "
    'table always has the MLA row',
    'ValueError: fused_norm_rope: indexer_k_cache: has (num_blocks, block_size) = (6, 8) but '
    'mla_kv_cache (6, 16); pcpkv writes both caches at one slot',
    'ValueError: fused_norm_rope: mla_k_scale: = 0.0 must be a finite, positive, normal float32 (in '
    '[2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, nan and inf are refused)',
    # issue 35 item 3: the indexer rows may have their own slots; a mapping of the wrong dtype is refused
    'ValueError: fused_norm_rope: indexer_slot_mapping: expected None or int64 [24] on cpu, got '
    'torch.int32 [24] strides [1] on cpu',
    'ValueError: fused_norm_rope: write_kv_output: = True (in-place kv_c / k_pe outputs) is not '
    'supported; pass kv_c_out / k_pe_out',
    'ValueError: fused_norm_rope: q_rms_eps: = nan must be finite (as float32) and >= 0',
    'ValueError: fused_norm_rope: kv_rms_eps: = 1e+300 must be finite (as float32) and >= 0',
    'ValueError: fused_norm_rope: index_k_layer_norm_eps: = -1.0 must be finite (as float32) and >= 0',
    'ValueError: fused_norm_rope: mla_k_scale: = 1e+300 must be a finite, positive, normal float32 (in '
    '[2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, nan and inf are refused)',
    'ValueError: fused_norm_rope: mla_k_scale: = 1e-45 must be a finite, positive, normal float32 (in '
    '[2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, nan and inf are refused)',
    'ValueError: fused_norm_rope: mla_k_scale: = 1e-39 must be a finite, positive, normal float32 (in '
    '[2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, nan and inf are refused)',
    'ValueError: fused_norm_rope: mla_k_scale: = 1.401298464324817e-45 must be a finite, positive, '
    'normal float32 (in [2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, nan and inf are refused)',
    'ValueError: fused_norm_rope: mla_k_scale: = -0.5 must be a finite, positive, normal float32 (in '
    '[2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, nan and inf are refused)',
    'ValueError: fused_norm_rope: mla_k_scale: = nan must be a finite, positive, normal float32 (in '
    '[2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, nan and inf are refused)',
    'ValueError: fused_norm_rope: mla_k_scale: = inf must be a finite, positive, normal float32 (in '
    '[2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, nan and inf are refused)',
    'ValueError: fused_norm_rope: mla_k_scale: = 0.0 must be a finite, positive, normal float32 (in '
    '[2^-126, 3.4e38]; 0, negatives, subnormals such as 1e-45, nan and inf are refused)',
    "ValueError: fused_norm_rope: ds_mla_scale: = 'recip'; expected 'raw' (vLLM's rule) or 'pow2'",
    'ValueError: fused_norm_rope: has_indexer: = 1 must be a bool',
    'ValueError: fused_norm_rope: kv_rms_norm_w: expected a float [512] weight on cpu, got '
    'torch.bfloat16 [512] strides [1] on meta',
    'ValueError: fused_norm_rope: k_pe: expected bfloat16 [24 (positions), 64] with unit inner stride on '
    "cpu (positions' device), got torch.bfloat16 [24, 64] strides [64, 1] on meta",
    'ValueError: fused_norm_rope: k_rope_cos_sin_cache: is on meta but positions on cpu',
    'ValueError: fused_norm_rope: topk_indices_buffer: expected int32 [>= 24, topk] on cpu whose first '
    '24 rows are contiguous, got torch.int32 [29, 64] strides [64, 1] on meta',
    'ValueError: fused_norm_rope: q_c_out: expected a contiguous bfloat16 [24, 256] on cpu, got '
    'torch.bfloat16 [24, 256] strides [256, 1] on meta',
    'ValueError: fused_norm_rope: slot_mapping: expected int64 [24] on cpu, got torch.int64 [24] strides '
    '[1] on meta',
    'ValueError: fused_norm_rope: q_c_out: shares memory with q_c (torch.bfloat16 [24, 256] strides '
    '[256, 1] on cpu): pcpkv reads the inputs and writes the outputs row by row in any order, so an '
    'output must not overlap an input or another output, got torch.bfloat16 [24, 256] strides [256, 1] on cpu',
    'ValueError: fused_norm_rope: q_c_out: shares memory with q_c (torch.bfloat16 [24, 256] strides '
    '[256, 1] on cpu): pcpkv reads the inputs and writes the outputs row by row in any order, so an '
    'output must not overlap an input or another output, got torch.bfloat16 [24, 256] strides [256, 1] on cpu',
    'ValueError: fused_norm_rope: kv_c_out: shares memory with k_pe_out (torch.bfloat16 [24, 64] strides '
    '[64, 1] on cpu): pcpkv reads the inputs and writes the outputs row by row in any order, so an '
    'output must not overlap an input or another output, got torch.bfloat16 [24, 512] strides [512, 1] on cpu',
    'ValueError: fused_norm_rope: index_k_out: shares memory with index_k (torch.bfloat16 [24, 128] '
    'strides [136, 1] on cpu): pcpkv reads the inputs and writes the outputs row by row in any order, so '
    'an output must not overlap an input or another output, got torch.bfloat16 [24, 128] strides [128, 1] on cpu',
    'ValueError: fused_norm_rope: mla_kv_cache: shares memory with kv_c (torch.bfloat16 [24, 512] '
    'strides [512, 1] on cpu): pcpkv reads the inputs and writes the outputs row by row in any order, so '
    'an output must not overlap an input or another output, got torch.uint8 [6, 16, 656] strides [10496, '
    '656, 1] on cpu',
    'ValueError: fused_norm_rope: mla_kv_cache: shares memory with indexer_k_cache (torch.uint8 [6, 16, '
    '132] strides [2112, 132, 1] on cpu): pcpkv reads the inputs and writes the outputs row by row in '
    'any order, so an output must not overlap an input or another output, got torch.uint8 [6, 16, 656] '
    'strides [10496, 656, 1] on cpu',
    'ValueError: fused_norm_rope: topk_indices_buffer: shares memory with slot_mapping (torch.int64 [24] '
    'strides [1] on cpu): pcpkv reads the inputs and writes the outputs row by row in any order, so an '
    'output must not overlap an input or another output, got torch.int32 [24, 64] strides [64, 1] on cpu',
    'ValueError: fused_norm_rope: positions: expected int64 [num_tokens] positions and q_c [num_tokens, '
    'q_lora_rank], got torch.int64 [24, 1] strides [1, 1] on cpu',
    'ValueError: fused_norm_rope: q_c: expected int64 [num_tokens] positions and q_c [num_tokens, '
    'q_lora_rank], got torch.bfloat16 [256] strides [1] on cpu',
    'ValueError: fused_norm_rope: positions: expected a tensor',
    'ValueError: fused_norm_rope: q_c: expected a tensor, got int',
    'ValueError: fused_norm_rope: mla_kv_cache: expected a tensor or None, got list',
    'ValueError: fused_norm_rope: mla_k_scale: expected None, a float or a float [1] tensor, got str',
    'ValueError: fused_norm_rope: mla_k_scale: expected None, a float or a float [1] tensor, got '
    'torch.float32 [2] strides [1] on cpu',
    'ValueError: fused_norm_rope: mla_k_scale: expected None, a float or a float [1] tensor, got '
    'torch.int64 [1] strides [1] on cpu',
    'ValueError: fused_norm_rope: q_rms_eps: = True must be a float',
    "ValueError: fused_norm_rope: kv_rms_eps: = '1e-5' must be a float",
    "ValueError: fused_norm_rope: mla_kv_cache_dtype: = 5; pcpkv maps ['auto', 'fp8', 'fp8_ds_mla', "
    "'fp8_e4m3'] (vLLM would write e4m3 bytes for any other string)",
    'ValueError: fused_norm_rope: has_indexer: = None must be a bool',
    'ValueError: fused_norm_rope: write_kv_output: = 1 must be a bool',
    'ValueError: fused_norm_rope: topk_indices_buffer: expected int32 [max_tokens, topk], got '
    'torch.int32 [64] strides [1] on cpu',
    'ValueError: fused_norm_rope: k_rope_cos_sin_cache: expected a float [max_position, 64] cos/sin '
    "cache ([cos 32 | sin 32] per position; pcpkv's rotary dims are 64), got torch.float64 [3000, 64] "
    'strides [128, 2] on cpu',
    'ValueError: fused_norm_rope: index_k_layer_norm_w: expected a float [128] weight on cpu, got '
    'torch.int32 [128] strides [1] on cpu',
    'ValueError: fused_norm_rope: index_k_layer_norm_bias: expected a float [128] weight on cpu, got '
    'torch.float32 [64] strides [1] on cpu',
    'ValueError: fused_norm_rope: index_k: expected bfloat16 [24 (positions), 128] with unit inner '
    "stride on cpu (positions' device), got torch.bfloat16 [24, 64] strides [136, 1] on cpu",
    'ValueError: fused_norm_rope: kv_c: expected bfloat16 [24 (positions), 512] with unit inner stride '
    "on cpu (positions' device), got torch.bfloat16 [24, 512] strides [1, 24] on cpu",
    'ValueError: fused_norm_rope: indexer_k_cache: expected uint8 or float8_e4m3fn [num_blocks, '
    'block_size, 132], got torch.int32 [6, 16, 132] strides [2112, 132, 1] on cpu',
    'ValueError: fused_norm_rope: indexer_k_cache: is on meta but mla_kv_cache on cpu',
    'ValueError: fused_norm_rope: mla_kv_cache: is on meta but positions on cpu',
    'ValueError: fused_norm_rope: index_k_rope_cos_sin_cache: is on meta but positions on cpu',
    "ValueError: fused_norm_rope: index_k_out: needs indexer_k_cache when mla_kv_cache is given (pcpkv's "
    'MLA-only write has no indexer output)',
    'ValueError: fused_norm_rope: slot_mapping: expected int64 [24] on cpu, got torch.int64 [23] strides '
    '[1] on cpu',
    'ValueError: pcpkv: dispatch: slot_mapping[0] = 96 is out of range [0, 96) (or -1 to skip)',
    'ValueError: dispatch: kv_c_out: expected contiguous BFloat16 [24, 512] on cpu, got BFloat16 [24, '
    '256] strides [256, 1] on cpu',
    'ValueError: fused_norm_rope: q_c_out: expected a contiguous bfloat16 [24, 256] on cpu, got '
    'torch.bfloat16 [24, 128] strides [256, 1] on cpu',
    'ValueError: fused_norm_rope: positions: expected int64 [num_tokens] positions and q_c [num_tokens, '
    'q_lora_rank], got torch.int64 [24, 1] strides [1, 1] on cpu',
    'ValueError: fused_norm_rope: q_c: expected int64 [num_tokens] positions and q_c [num_tokens, '
    'q_lora_rank], got torch.bfloat16 [256] strides [1] on cpu',
]
# fmt: on


def all_cases():
    return [o for o, _ in bad_cases("cpu")] + [o for o, _, _ in overlap_cases("cpu")] + extra_cases()


def refusal(over):
    a = vllm_inputs("cpu", "fp8_ds_mla", seed=5)
    for k, v in over.items():
        a[k] = v(a) if callable(v) else v
    with pytest.raises(Exception) as e:
        fused_norm_rope(**a)
    return f"{type(e.value).__name__}: {e.value}"


def test_refusals_keep_the_python_mappings_words():
    cases = all_cases()
    assert len(cases) == len(MESSAGES), "a case without its recorded message (or a message without its case)"
    for i, (over, want) in enumerate(zip(cases, MESSAGES)):
        assert refusal(over) == want, f"case {i}: {sorted(over)}"
