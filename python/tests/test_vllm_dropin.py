"""pcpkv_torch.vllm.fused_norm_rope (vLLM's DeepSeek-V3.2 signature) against pcpkv's own dispatch op on the
same inputs: q_c_out, every byte of both caches and the whole top-k buffer must be equal."""

import pytest

from helpers import (DEVICES, GUARD, POISON_BF16, POISON_I32, assert_bytes_equal, llm_like, norm_weight, pk,
                     requires_cuda, torch)

from pcpkv_torch.vllm import fused_norm_rope

NUM_BLOCKS, BLOCK_SIZE, Q_LORA, T, TOPK = 6, 16, 256, 24, 64
ROPE = pk.RopeSpec("deepseek_yarn", 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
MLA_LAST = {"auto": 576, "fp8": 576, "fp8_e4m3": 576, "fp8_ds_mla": 656}
PCPKV_FORMAT = {"auto": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_ds_mla": "fp8_ds_mla"}


def vllm_inputs(device, kv_dtype, *, seed=0, has_indexer=True, rope_dtype=torch.bfloat16):
    """Arguments as vLLM's DSV32 attention builds them: q_c / kv_c / k_pe split from one projection, index_k a
    slice of the indexer's fused wk + weights_proj output, bf16 weights and cos/sin caches, two distinct
    tables of equal values, a top-k buffer with more rows than tokens, padding slots, guarded caches."""
    gen = torch.Generator().manual_seed(seed)
    qkv = llm_like(gen, T, Q_LORA + 512 + 64).to(device)
    q_c, kv_c, k_pe = qkv.split([Q_LORA, 512, 64], dim=-1)
    kw = llm_like(gen, T, 128 + 8).to(device)
    num_pos = 3000
    table = pk.rope_table(ROPE, num_pos, device).to(rope_dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:4]] = -1  # padding tokens write no row
    mla_dtype = torch.bfloat16 if kv_dtype == "auto" else torch.uint8
    mla = torch.empty((NUM_BLOCKS, BLOCK_SIZE, MLA_LAST[kv_dtype]), dtype=mla_dtype, device=device)
    mla.view(torch.uint8).fill_(GUARD)
    a = dict(positions=torch.randperm(num_pos, generator=gen)[:T].to(device), q_c=q_c,
             q_rms_norm_w=norm_weight(gen, Q_LORA).to(torch.bfloat16).to(device), q_rms_eps=1e-6, kv_c=kv_c,
             kv_rms_norm_w=norm_weight(gen, 512).to(torch.bfloat16).to(device), kv_rms_eps=1e-5, k_pe=k_pe,
             k_rope_cos_sin_cache=table, index_k=kw[:, :128] if has_indexer else None,
             index_k_layer_norm_w=norm_weight(gen, 128).to(device) if has_indexer else None,
             index_k_layer_norm_bias=(0.1 * norm_weight(gen, 128)).to(device) if has_indexer else None,
             index_k_layer_norm_eps=1e-6, index_k_rope_cos_sin_cache=table.clone() if has_indexer else None,
             topk_indices_buffer=torch.full((T + 5, TOPK), POISON_I32, dtype=torch.int32, device=device),
             slot_mapping=slots.to(device),
             indexer_k_cache=torch.full((NUM_BLOCKS, BLOCK_SIZE, 132), GUARD, dtype=torch.uint8, device=device),
             mla_kv_cache=mla, mla_kv_cache_dtype=kv_dtype,
             mla_k_scale=torch.tensor([0.5], device=device) if kv_dtype.startswith("fp8_e") or kv_dtype == "fp8"
             else None, has_indexer=has_indexer, index_rope_interleave=False,
             q_c_out=torch.full((T, Q_LORA), POISON_BF16, dtype=torch.bfloat16, device=device))
    return a


def clone_outputs(a):
    """A second set of the written tensors (caches, top-k buffer, q_c_out), same starting bytes."""
    b = dict(a)
    for k in ("topk_indices_buffer", "indexer_k_cache", "mla_kv_cache", "q_c_out"):
        if isinstance(a[k], torch.Tensor):
            b[k] = a[k].clone()
    return b


def pcpkv_reference(a, *, ds_mla_scale="raw", writes_index=True, **outs):
    """The same work through pcpkv_torch.dispatch, arguments mapped by hand."""
    has_idx = a["has_indexer"]
    caches = a["slot_mapping"] is not None and a["mla_kv_cache"] is not None
    k_scale = float(a["mla_k_scale"]) if a["mla_k_scale"] is not None else 1.0
    fmt = pk.CacheFormat(PCPKV_FORMAT[a["mla_kv_cache_dtype"]], ds_mla_scale,
                         k_scale if PCPKV_FORMAT[a["mla_kv_cache_dtype"]] == "fp8" else 1.0,
                         has_indexer=has_idx and (writes_index or not caches))
    targets = None
    if caches:
        mla = a["mla_kv_cache"].view(torch.uint8)
        targets = pk.CacheTargets.from_caches([mla], [a["indexer_k_cache"]] if fmt.has_indexer else None, fmt)
    pk.dispatch(a["kv_c"], a["k_pe"], a["positions"], a["kv_rms_norm_w"], a["k_rope_cos_sin_cache"].float(),
                fmt=fmt, q_c=a["q_c"], q_norm_w=a["q_rms_norm_w"], q_c_out=a["q_c_out"],
                index_k=a["index_k"] if fmt.has_indexer else None,
                index_ln_w=a["index_k_layer_norm_w"] if fmt.has_indexer else None,
                index_ln_b=a["index_k_layer_norm_bias"] if fmt.has_indexer else None,
                slot_mapping=a["slot_mapping"] if caches else None, targets=targets,
                topk_fill=a["topk_indices_buffer"][:T] if has_idx else None, q_eps=a["q_rms_eps"],
                kv_eps=a["kv_rms_eps"], index_eps=a["index_k_layer_norm_eps"],
                index_rope_interleaved=a["index_rope_interleave"], **outs)


def assert_same(got, want, *, wrote_caches=True, wrote_index=True):
    assert_bytes_equal(got["q_c_out"].view(torch.uint8), want["q_c_out"].view(torch.uint8), "q_c_out")
    assert_bytes_equal(got["mla_kv_cache"].view(torch.uint8), want["mla_kv_cache"].view(torch.uint8), "mla_kv_cache")
    assert_bytes_equal(got["indexer_k_cache"], want["indexer_k_cache"], "indexer_k_cache")
    assert_bytes_equal(got["topk_indices_buffer"], want["topk_indices_buffer"], "topk_indices_buffer")
    # Both sides doing nothing would pass the comparisons: check that the expected writes happened.
    assert not (got["q_c_out"] == POISON_BF16).all()
    assert (got["mla_kv_cache"].view(torch.uint8) != GUARD).any().item() == wrote_caches
    assert (got["indexer_k_cache"] != GUARD).any().item() == (wrote_caches and wrote_index and got["has_indexer"])
    topk = got["topk_indices_buffer"].cpu()
    assert (topk[T:] == POISON_I32).all(), "rows past the tokens must stay untouched"
    assert (topk[:T] == (-1 if got["has_indexer"] else POISON_I32)).all()


def run_both(a, **kw):
    got, want = clone_outputs(a), clone_outputs(a)
    out = fused_norm_rope(**got, **kw)
    assert out is got["q_c_out"]
    pcpkv_reference(want, ds_mla_scale=kw.get("ds_mla_scale", "raw"))
    return got, want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["fp8_ds_mla", "fp8", "fp8_e4m3", "auto"])
@pytest.mark.parametrize("has_indexer", [True, False])
def test_equals_pcpkv_op(device, kv_dtype, has_indexer):
    a = vllm_inputs(device, kv_dtype, has_indexer=has_indexer)
    got, want = run_both(a)
    assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_index_rope_pow2_scales_fp32_table(device):
    a = vllm_inputs(device, "fp8_ds_mla", seed=3, rope_dtype=torch.float32)
    a["index_rope_interleave"] = True
    got, want = run_both(a, ds_mla_scale="pow2")
    assert_same(got, want)
    raw = clone_outputs(a)
    fused_norm_rope(**raw)
    assert (raw["mla_kv_cache"] != got["mla_kv_cache"]).any(), "pow2 and raw scales must give other bytes"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("has_indexer", [True, False])
def test_materialized_outputs(device, has_indexer):
    """kv_c_out / k_pe_out / index_k_out of later vLLM versions (the PCP prefill path, no caches); a shared
    layer leaves index_k_out untouched, as vLLM's kernel does."""
    a = vllm_inputs(device, "fp8_ds_mla", seed=1, has_indexer=has_indexer)
    a.update(slot_mapping=None)
    outs = {k: torch.full((T, n), POISON_BF16, dtype=torch.bfloat16, device=device)
            for k, n in (("kv_c_out", 512), ("k_pe_out", 64), ("index_k_out", 128))}
    got, want = clone_outputs(a), clone_outputs(a)
    got_outs = {k: v.clone() for k, v in outs.items()}
    fused_norm_rope(**got, **got_outs)
    pcpkv_reference(want, **{k: v for k, v in outs.items() if has_indexer or k != "index_k_out"})
    assert_same(got, want, wrote_caches=False)
    for k in outs:
        assert_bytes_equal(got_outs[k].view(torch.uint8), outs[k].view(torch.uint8), k)
        written = has_indexer or k != "index_k_out"
        assert bool((got_outs[k] == POISON_BF16).all()) != written, f"{k}: written = {not written}"
        if written:
            assert not (got_outs[k] == POISON_BF16).any(), f"{k}: rows left unwritten"


@pytest.mark.parametrize("device", DEVICES)
def test_profiling_run_and_mla_only(device):
    # vLLM's profiling run: no slot mapping / caches -> only q_c_out and the top-k fill.
    a = vllm_inputs(device, "fp8_ds_mla", seed=2)
    a.update(slot_mapping=None)
    got, want = run_both(a)
    assert_same(got, want, wrote_caches=False)
    # MLA cache without an indexer cache on an indexer layer: MLA rows only, top-k still filled.
    a = vllm_inputs(device, "fp8_ds_mla", seed=2)
    got, want = clone_outputs(a), clone_outputs(a)
    got["indexer_k_cache"] = None
    fused_norm_rope(**got)
    pcpkv_reference(want, writes_index=False)
    got["indexer_k_cache"] = a["indexer_k_cache"]  # untouched original, compared with want's (unwritten) copy
    assert_same(got, want, wrote_index=False)


@pytest.mark.parametrize("device", DEVICES)
def test_scale_as_float_and_same_index_table(device):
    a = vllm_inputs(device, "fp8", seed=4)
    a["index_k_rope_cos_sin_cache"] = a["k_rope_cos_sin_cache"]  # the very same tensor
    got, want = clone_outputs(a), clone_outputs(a)
    got["mla_k_scale"] = 0.5
    fused_norm_rope(**got)
    pcpkv_reference(want)
    assert_same(got, want)


def bad_cases(device):
    """(argument overrides, the name the ValueError must contain)."""
    f16 = lambda t: t.to(torch.float16)  # noqa: E731
    return [
        (dict(mla_kv_cache_dtype="fp8_e5m2"), "mla_kv_cache_dtype"),
        (dict(mla_kv_cache_dtype="bfloat16"), "mla_kv_cache_dtype"),
        (dict(mla_kv_cache_dtype="auto"), "mla_kv_cache"),  # a uint8 656-byte cache is not a bf16 one
        (dict(q_c=lambda a: f16(a["q_c"])), "q_c"),
        # widths pcpkv's dispatch does not take: 0 (null pointers, which the op read as "no Q norm": it wrote the
        # caches and raised nothing), 12 and 4104 (refused by the op only, as "dispatch: q_lora_rank")
        *[(dict(q_c=lambda a, n=n: torch.zeros((T, n), dtype=torch.bfloat16, device=device),
                q_rms_norm_w=lambda a, n=n: torch.ones(n, device=device), q_c_out=None),
           rf"q_c: width q_lora_rank = {n} must be a multiple of 8 in \[8, 4096\]") for n in (0, 12, 4104)],
        (dict(kv_c=lambda a: a["kv_c"][:, :256]), "kv_c"),
        (dict(k_pe=lambda a: a["k_pe"][:-1]), "k_pe"),
        (dict(positions=lambda a: a["positions"].int()), "positions"),
        (dict(q_rms_norm_w=lambda a: a["q_rms_norm_w"][:8]), "q_rms_norm_w"),
        (dict(k_rope_cos_sin_cache=lambda a: a["k_rope_cos_sin_cache"][:, :32]), "k_rope_cos_sin_cache"),
        (dict(index_k_rope_cos_sin_cache=lambda a: a["index_k_rope_cos_sin_cache"] * 2), "index_k_rope_cos_sin_cache"),
        (dict(index_k_rope_cos_sin_cache=None), "index_k_rope_cos_sin_cache"),
        (dict(index_k=None), "index_k"),
        (dict(topk_indices_buffer=lambda a: a["topk_indices_buffer"][: T - 1]), "topk_indices_buffer"),
        (dict(topk_indices_buffer=lambda a: a["topk_indices_buffer"].long()), "topk_indices_buffer"),
        (dict(topk_indices_buffer=lambda a: a["topk_indices_buffer"][:, ::2]), "topk_indices_buffer"),
        (dict(q_c_out=lambda a: torch.empty((Q_LORA, T), dtype=torch.bfloat16, device=device).t()), "q_c_out"),
        (dict(slot_mapping=lambda a: a["slot_mapping"].int()), "slot_mapping"),
        (dict(mla_kv_cache=None), "mla_kv_cache"),
        (dict(indexer_k_cache=lambda a: a["indexer_k_cache"][:, :8]), "indexer_k_cache"),
        (dict(mla_k_scale=0.0, mla_kv_cache_dtype="fp8", mla_kv_cache=lambda a: a["mla_kv_cache"][..., :576]),
         "mla_k_scale"),
        (dict(indexer_slot_mapping=lambda a: a["slot_mapping"].int()), "indexer_slot_mapping"),
        (dict(write_kv_output=True), "write_kv_output"),
        # refused by the op as pcpkv's "q_eps" / "kv_eps" / "k_scale" (1e300: as float32 inf), without these names
        (dict(q_rms_eps=float("nan")), "q_rms_eps"), (dict(kv_rms_eps=1e300), "kv_rms_eps"),
        (dict(index_k_layer_norm_eps=-1.0), "index_k_layer_norm_eps"),
        (dict(mla_k_scale=1e300, mla_kv_cache_dtype="fp8", mla_kv_cache=lambda a: a["mla_kv_cache"][..., :576]),
         "mla_k_scale"),
        # not a finite positive normal float32: subnormals (1e-45, 1e-39; a float32 tensor of 1e-45) were accepted
        *[(dict(mla_k_scale=v, mla_kv_cache_dtype="fp8", mla_kv_cache=lambda a: a["mla_kv_cache"][..., :576]),
           r"mla_k_scale: = .* must be a finite, positive, normal float32")
          for v in (1e-45, 1e-39, lambda a: torch.tensor([1e-45], device=device), -0.5, float("nan"), float("inf"),
                    lambda a: torch.tensor([0.0], device=device))],
        (dict(ds_mla_scale="recip"), "ds_mla_scale"),
        (dict(has_indexer=1), "has_indexer"),
        # another device than positions' (meta stands in for a GPU where there is none)
        (dict(kv_rms_norm_w=lambda a: a["kv_rms_norm_w"].to("meta")), "kv_rms_norm_w"),
        (dict(k_pe=lambda a: a["k_pe"].to("meta")), "k_pe"),
        (dict(k_rope_cos_sin_cache=lambda a: a["k_rope_cos_sin_cache"].to("meta")), "k_rope_cos_sin_cache"),
        (dict(topk_indices_buffer=lambda a: a["topk_indices_buffer"].to("meta")), "topk_indices_buffer"),
        (dict(q_c_out=lambda a: a["q_c_out"].to("meta")), "q_c_out"),
        (dict(slot_mapping=lambda a: a["slot_mapping"].to("meta")), "slot_mapping"),
    ]


WRITTEN = ("topk_indices_buffer", "indexer_k_cache", "mla_kv_cache", "q_c_out")


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_name_the_argument(device):
    for over, name in bad_cases(device):
        a = vllm_inputs(device, "fp8_ds_mla", seed=5)
        orig = {k: a[k] for k in WRITTEN}  # overrides may swap in views of these: check the originals
        before = {k: v.clone() for k, v in orig.items()}
        for k, v in over.items():
            a[k] = v(a) if callable(v) else v
        with pytest.raises(ValueError, match=name) as e:
            fused_norm_rope(**a)
        assert "fused_norm_rope" in str(e.value), f"{name}: {e.value}"
        for k in WRITTEN:
            assert_bytes_equal(orig[k].view(torch.uint8), before[k].view(torch.uint8), f"{name}: {k} was written")


def internal_name_cases(device):
    """(argument overrides, the caller's argument the ValueError must name): caches and a scale the drop-in refused
    under the names of its internals (CacheTargets' mla_ptrs[0], like_mla, like_index, make_cache_targets' target 0)
    or as a RuntimeError (a meta mla_k_scale's .item()), issue 31 item 9."""
    bytes_ = dict(dtype=torch.uint8, device=device)
    fp8 = dict(mla_kv_cache_dtype="fp8", mla_kv_cache=lambda a: a["mla_kv_cache"][..., :576])
    return [
        # no blocks: a null data pointer (CacheTargets: mla_ptrs[0] = 0 is not a non-null address)
        (dict(mla_kv_cache=torch.empty((0, BLOCK_SIZE, 656), **bytes_),
              indexer_k_cache=torch.empty((0, BLOCK_SIZE, 132), **bytes_)), "mla_kv_cache"),
        # rows overlapping (row stride 0; CacheTargets: like_mla: rows or blocks overlap)
        (dict(mla_kv_cache=torch.zeros((NUM_BLOCKS, 1, 656), **bytes_).expand(NUM_BLOCKS, BLOCK_SIZE, 656)),
         "mla_kv_cache"),
        # block_size 12, not a power of two (make_cache_targets: target 0: mla cache: block_size = 12 ...)
        (dict(mla_kv_cache=torch.zeros((8, 12, 656), **bytes_), indexer_k_cache=torch.zeros((8, 12, 132), **bytes_)),
         "mla_kv_cache"),
        # a row stride of 664 B, not a multiple of 16 (make_cache_targets: target 0: mla cache: row_stride = 664 ...)
        (dict(mla_kv_cache=torch.zeros((NUM_BLOCKS, BLOCK_SIZE, 664), **bytes_)[..., :656]), "mla_kv_cache"),
        # indexer rows 264 B apart (CacheTargets: like_index: expected ... the rows of a block contiguous)
        (dict(indexer_k_cache=torch.zeros((NUM_BLOCKS, BLOCK_SIZE, 264), **bytes_)[..., :132]), "indexer_k_cache"),
        # a meta k_scale has no value (.item() raised RuntimeError)
        (dict(mla_k_scale=torch.tensor([0.5], device="meta"), **fp8), "mla_k_scale"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_caches_and_scale_are_named_as_the_callers_arguments(device):
    for over, name in internal_name_cases(device):
        a = vllm_inputs(device, "fp8_ds_mla", seed=5)
        orig = {k: a[k] for k in WRITTEN}
        before = {k: v.clone() for k, v in orig.items()}
        for k, v in over.items():
            a[k] = v(a) if callable(v) else v
        with pytest.raises(ValueError, match=rf"^fused_norm_rope: {name}: ") as e:
            fused_norm_rope(**a)
        for internal in ("CacheTargets", "like_mla", "like_index", "mla_ptrs", "make_cache_targets"):
            assert internal not in str(e.value), f"{name}: {e.value}"
        for k in WRITTEN:
            assert_bytes_equal(orig[k].view(torch.uint8), before[k].view(torch.uint8), f"{name}: {k} was written")


def overlap_cases(device):
    """(argument overrides, output, the argument it shares memory with): each passes every other check."""
    bf16 = dict(dtype=torch.bfloat16, device=device)
    shifted = torch.ones((T + 1, Q_LORA), **bf16)  # q_c rows 1.. and q_c_out rows ..T-1 of one buffer
    outs = torch.full((T * 576,), POISON_BF16, **bf16)  # kv_c_out, then k_pe_out starting one row early
    mla_bytes = lambda a: a["mla_kv_cache"].view(-1)  # noqa: E731
    return [
        (dict(q_c=lambda a: a["q_c_out"]), "q_c_out", "q_c"),  # in place
        (dict(q_c=shifted[1:], q_c_out=shifted[:T]), "q_c_out", "q_c"),
        (dict(kv_c_out=outs[:T * 512].view(T, 512), k_pe_out=outs[T * 448:T * 512].view(T, 64)), "kv_c_out",
         "k_pe_out"),
        (dict(index_k_out=lambda a: a["index_k"].as_strided((T, 128), (128, 1))), "index_k_out", "index_k"),
        (dict(kv_c=lambda a: mla_bytes(a)[:T * 1024].view(torch.bfloat16).view(T, 512)), "mla_kv_cache", "kv_c"),
        (dict(indexer_k_cache=lambda a: mla_bytes(a)[-NUM_BLOCKS * BLOCK_SIZE * 132:].view(
            NUM_BLOCKS, BLOCK_SIZE, 132)), "mla_kv_cache", "indexer_k_cache"),
        (dict(slot_mapping=lambda a: a["topk_indices_buffer"].view(-1)[:2 * T].view(torch.int64)),
         "topk_indices_buffer", "slot_mapping"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_sharing_memory_are_refused(device):
    """An output (q_c_out, kv_c_out, k_pe_out, index_k_out, the top-k rows, the caches written) sharing memory with
    an input or another output was accepted (in place, rows shifted by one, a cache holding kv_c, the indexer cache
    inside the MLA cache): refused naming both, with no byte of any argument changed."""
    for over, out, other in overlap_cases(device):
        a = vllm_inputs(device, "fp8_ds_mla", seed=5)
        for k, v in over.items():
            a[k] = v(a) if callable(v) else v
        before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
        with pytest.raises(ValueError, match=rf"fused_norm_rope: {out}: shares memory with {other} \("):
            fused_norm_rope(**a)
        for k, v in before.items():
            assert_bytes_equal(a[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8),
                               f"{out} / {other}: {k} was written")


def test_top_k_rows_past_the_tokens_may_hold_an_input():
    """Only topk_indices_buffer[:T] is written: an input in the rows past T shares no written byte."""
    a = vllm_inputs("cpu", "fp8_ds_mla", seed=5)
    want = clone_outputs(a)
    got = clone_outputs(a)
    tail = got["topk_indices_buffer"][T:].view(-1)[:2 * T].view(torch.int64)
    tail.copy_(a["slot_mapping"])
    got["slot_mapping"] = tail
    fused_norm_rope(**got)
    pcpkv_reference(want)
    got["topk_indices_buffer"][T:] = POISON_I32  # the input's bytes, put back to the poison to compare the rest
    assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compiled_equals_eager(device):
    """The custom op's schema (mutation marks, fake kernel, functionalized dispatch), and the drop-in under
    torch.compile(fullgraph=True), as vLLM compiles its model forward: the bytes of the eager call."""
    a = vllm_inputs(device, "fp8_ds_mla", seed=6)
    args = dict(clone_outputs(a))
    scale_t, scale_v = None, 1.0
    op_args = [args[k] for k in ("positions", "q_c", "q_rms_norm_w", "q_rms_eps", "kv_c", "kv_rms_norm_w",
                                 "kv_rms_eps", "k_pe", "k_rope_cos_sin_cache", "index_k", "index_k_layer_norm_w",
                                 "index_k_layer_norm_bias", "index_k_layer_norm_eps", "index_k_rope_cos_sin_cache",
                                 "topk_indices_buffer", "slot_mapping", "indexer_k_cache", "mla_kv_cache",
                                 "mla_kv_cache_dtype")]
    op_args += [scale_t, scale_v, True, False, args["q_c_out"], None, None, None, None, "raw"]
    torch.library.opcheck(torch.ops.pcpkv_vllm.fused_norm_rope.default, op_args)

    eager, comp = clone_outputs(a), clone_outputs(a)
    fused_norm_rope(**eager)

    @torch.compile(fullgraph=True, backend="inductor")
    def step(x):
        return fused_norm_rope(**x)

    step(comp)
    if device == "cuda":
        torch.cuda.synchronize()
    assert_same(comp, eager)


@pytest.mark.parametrize("device", DEVICES)
def test_under_inference_mode(device):
    """vLLM runs its forward under torch.inference_mode, whose tensors have no version counter (the memos of
    the converted cos/sin tables and the k_scale read must cope), called twice to use the memos."""
    with torch.inference_mode():
        a = vllm_inputs(device, "fp8", seed=7)
        for _ in range(2):
            got, want = run_both(a)
            assert_same(got, want)


@requires_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8_ds_mla", "fp8"])
def test_cuda_graph_replay_equals_eager(kv_dtype):
    """Engines capture the layer in a CUDA graph: after one warm-up call (tables converted, k_scale read, cache
    table built) the call captures, and each replay writes the eager call's bytes, on fresh inputs too."""
    a = vllm_inputs("cuda", kv_dtype, seed=8)
    g = clone_outputs(a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_norm_rope(**g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_norm_rope(**g)
    gen = torch.Generator().manual_seed(9)
    for replay in range(2):
        for k in ("q_c", "kv_c", "k_pe", "index_k"):  # new activations in place (the graph reads these addresses)
            a[k].copy_(llm_like(gen, T, a[k].shape[1]).to("cuda"))
        for k in WRITTEN:
            g[k].copy_(a[k])  # the starting bytes again
        eager = clone_outputs(a)
        fused_norm_rope(**eager)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(g, eager)


@pytest.mark.parametrize("device", DEVICES)
def test_tables_changed_in_place_are_converted_again(device):
    """The converted cos/sin tables and weights are reused while their sources are unmodified: a source
    changed in place (its version moves) is converted again, never served stale."""
    a = vllm_inputs(device, "fp8_ds_mla", seed=12)
    fused_norm_rope(**clone_outputs(a))
    for k in ("k_rope_cos_sin_cache", "index_k_rope_cos_sin_cache"):
        a[k].copy_(pk.rope_table(pk.RopeSpec("default", 1e6), a[k].shape[0], device).to(a[k].dtype))
    a["kv_rms_norm_w"].mul_(2)
    got, want = run_both(a)
    assert_same(got, want)
