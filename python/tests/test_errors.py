"""Bad arguments raise ValueError naming the argument before anything is written or launched, on every device.

The first test checks the error path itself on the CPU: a C++ exception leaving pcpkv_torch._C (a translated
pcpkv::Error and a TORCH_CHECK_VALUE) arrives in Python as ValueError. run_device_tests.sh runs this file
first, in its own process, so a broken error path shows up here by name instead of as a crash elsewhere.

After every rejected call the caches still hold only guard bytes, the staging buffers only zeros and the
outputs only their poison: nothing was written (on CUDA: checked after a synchronize, so nothing was
launched that wrote either)."""

import re
import warnings

import pytest

from helpers import DEVICES, GUARD, POISON_I32, World, pk, torch


def small_plan(world, seed=0):
    reqs = [pk.Request(37, 0), pk.Request(50, 11), pk.Request(1, 20, decode=True), pk.Request(1, 5, decode=True)]
    return pk.make_plan(world, reqs, block_size=16, extra_blocks=2, seed=seed)


def test_cpp_errors_reach_python_as_value_error():
    # pcpkv::Error thrown in pcpkv's core, translated to ValueError by csrc/checks.h translate_errors
    with pytest.raises(ValueError, match="num_positions = 0"):
        torch.ops.pcpkv.rope_table(0, "default", 10000.0, 1.0, 4096, 32.0, 1.0, 1.0, 1.0)
    # TORCH_CHECK_VALUE of the tensor checks (csrc/checks.cpp), CPU tensors
    kv = torch.zeros(4, 512, dtype=torch.float32) + 1
    k_pe = torch.ones(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dispatch: kv: expected bfloat16"):
        torch.ops.pcpkv.dispatch(kv, k_pe, torch.zeros(4, dtype=torch.long), torch.ones(512), torch.ones(8, 64),
                                 None, None, None, None, None, None, None, None, None, None, None, None, None, None,
                                 None, [], "bf16", "pow2", 1.0, False, 1e-6, 1e-6, 1e-6, True, False, False)
    # the same error twice in a row (a broken unwinder or exception ABI tends to fail the second time)
    with pytest.raises(ValueError, match="num_positions = 0"):
        torch.ops.pcpkv.rope_table(0, "default", 10000.0, 1.0, 4096, 32.0, 1.0, 1.0, 1.0)


def assert_nothing_written(w, what):
    if w.device.type == "cuda":
        torch.cuda.synchronize()
    for r in range(w.W):
        assert bool((w.flat(w.mla[r]) == GUARD).all()), f"{what}: MLA replica {r} was written"
        assert bool((w.flat(w.idx[r]) == GUARD).all()), f"{what}: indexer replica {r} was written"
        assert int(w.staging[r].count_nonzero()) == 0, f"{what}: staging of rank {r} was written"
        assert bool((w.local[r]["topk"] == POISON_I32).all()), f"{what}: topk of rank {r} was written"
        assert bool((w.local[r]["q_c_out"] == 7.0).all()), f"{what}: q_c_out of rank {r} was written"


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_errors_name_the_argument(device):
    plan = small_plan(2)
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = World(plan, fmt, device, seed=3)
    loc, wt = w.local[0], w.weights
    M = w.M

    def call(match, **over):
        args = dict(kv=loc["kv"], k_pe=loc["k_pe"], positions=loc["positions"], kv_norm_w=wt["kv_norm_w"],
                    rope_cos_sin=w.rope_cos_sin)
        kw = dict(fmt=fmt, q_c=loc["q_c"], q_norm_w=wt["q_norm_w"], q_c_out=loc["q_c_out"], index_k=loc["index_k"],
                  index_ln_w=wt["index_ln_w"], index_ln_b=wt["index_ln_b"], slot_mapping=loc["slot_mapping"],
                  targets=w.targets, row_dests=w.dests[0], topk_fill=loc["topk"])
        for k, v in over.items():
            (args if k in args else kw)[k] = v
        with pytest.raises(ValueError, match=match):
            pk.dispatch(*args.values(), **kw)
        assert_nothing_written(w, match)

    call("kv: expected bfloat16", kv=loc["kv"].float())
    call(r"dispatch: fmt = 'fp8_ds_mla' must be a CacheFormat \(e.g. CacheFormat\('fp8_ds_mla'\)",
         fmt="fp8_ds_mla")  # was AttributeError
    call("k_pe: expected bfloat16", k_pe=loc["k_pe"][:, :32])
    call("positions: expected", positions=loc["positions"].int())
    call("kv_norm_w: expected", kv_norm_w=wt["kv_norm_w"][:256])
    call("rope_cos_sin: expected", rope_cos_sin=w.rope_cos_sin[:, :32])
    call("q_c and q_c_out go together", q_c_out=None)
    call("q_norm_w", q_norm_w=wt["q_norm_w"][:8])
    call("kv_eps = nan must be finite", kv_eps=float("nan"))
    # named as given: 1e300 became the float32 inf and was reported as "q_eps = inf"
    call(r"dispatch: q_eps = 1e\+300 overflows the float32", q_eps=1e300)
    call(r"dispatch: index_eps = -1e\+39 overflows the float32", index_eps=-1e39)
    # a zero-width q_c has null data pointers, which the kernel contract reads as "no Q norm" (it wrote the rest)
    no_q = torch.zeros(M, 0, dtype=torch.bfloat16, device=w.device)
    call(r"dispatch: q_c: q_lora_rank \(its width\) = 0 must be a multiple of 8", q_c=no_q, q_c_out=no_q.clone(),
         q_norm_w=torch.ones(0, device=w.device))
    # outputs sharing memory with an input or another output (in place; kv_c_out's last row is k_pe_out's first)
    call(r"dispatch: q_c_out \(.*\) shares memory with q_c \(", q_c=loc["q_c_out"])
    outs = torch.zeros(M * 576, dtype=torch.bfloat16, device=w.device)
    call(r"dispatch: kv_c_out \(.*\) shares memory with k_pe_out \(", kv_c_out=outs[:M * 512].view(M, 512),
         k_pe_out=outs[M * 448:M * 512].view(M, 64))
    call(r"dispatch: topk_fill \(.*\) shares memory with slot_mapping \(",
         slot_mapping=loc["topk"].view(-1)[:2 * M].view(torch.int64))
    # an input inside a replica the tables write (written[0]: targets.tensors[0], rank 0's MLA cache)
    call(r"dispatch: written\[0\] \(.*\) shares memory with kv \(",
         kv=w.flat(w.mla[0])[:M * 1024].view(torch.bfloat16).view(M, 512))
    call("index_k, index_ln_w and index_ln_b are required", index_k=None)
    call("index_k / index_k_out given but has_indexer=False", fmt=pk.CacheFormat("fp8_ds_mla", has_indexer=False),
         row_dests=None, targets=None)  # with the targets, their format (has_indexer=True) is named first
    call("topk_fill: expected", topk_fill=loc["topk"].long())
    call("slot_mapping: expected", slot_mapping=loc["slot_mapping"][:3])
    call("kv_c_out: expected", kv_c_out=torch.zeros(M, 256, dtype=torch.bfloat16, device=w.device))
    # a slot mapping is required to write caches
    call("slot_mapping", slot_mapping=None, row_dests=None)
    # tables: a device table that does not match its host copy, or tables of the wrong kind
    short = pk.CacheTargets(w.targets.host, w.targets.table[:1], w.targets.tensors)
    call("targets", targets=short)
    dests32 = pk.RowDests(w.dests[0].host, w.dests[0].table.int(), w.dests[0].tensors)
    call("row_dests", row_dests=dests32)
    # a hand-made table whose records disagree (a smaller replica would be written past its end)
    small = pk.CacheTargets.from_caches([pk.allocate_mla_cache(1, plan.block_size, "fp8_ds_mla", w.device, fill=GUARD)],
                                        [pk.allocate_indexer_cache(1, plan.block_size, w.device, fill=GUARD)], fmt)
    mixed_host = torch.cat([w.targets.host[:1], small.host])
    mixed = pk.CacheTargets(mixed_host, mixed_host.to(w.device), w.targets.tensors + small.tensors)
    call(r"targets(_host)?\[1\]: MLA geometry", targets=mixed)
    assert bool((w.flat(small.tensors[0]) == GUARD).all()) and bool((w.flat(small.tensors[1]) == GUARD).all())
    # a table whose geometry can not hold the format's rows (bf16 rows are wider than fp8_ds_mla's): the format the
    # targets record is named first (check_targets); a table of unknown format meets the op's geometry check
    call(re.escape("(kv_format 'bf16' vs 'fp8_ds_mla')"), fmt=pk.CacheFormat("bf16"), row_dests=None)
    call("row_stride|smaller", fmt=pk.CacheFormat("bf16"), row_dests=None,
         targets=pk.CacheTargets(w.targets.host, w.targets.table, w.targets.tensors))
    # staging slots sized for another format's rows
    call("row_dests: .* rows", fmt=pk.CacheFormat("fp8_ds_mla", has_indexer=False), index_k=None, index_ln_w=None,
         index_ln_b=None, topk_fill=None, targets=None)
    if device == "cpu":
        # only the CPU reads slot and position values on the host (CUDA skips bad rows, see validate_slots)
        bad = loc["slot_mapping"].clone()
        bad[3] = plan.num_slots + 5
        call(r"slot_mapping\[3\]", slot_mapping=bad)
        bad_pos = loc["positions"].clone()
        bad_pos[2] = w.rope_cos_sin.shape[0]
        call(r"positions\[2\]", positions=bad_pos)
    else:
        # tensors on two devices: the CUDA op is picked and rejects the CPU tensor by name
        call("positions: expected", positions=loc["positions"].cpu())
        cpu_targets = pk.CacheTargets(w.targets.host, w.targets.host, w.targets.tensors)
        call("targets", targets=cpu_targets)


@pytest.mark.parametrize("device", DEVICES)
def test_combine_insert_fence_errors_name_the_argument(device):
    plan = small_plan(2)
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = World(plan, fmt, device, seed=4)
    rows = w.staging[0][0, 0]
    with pytest.raises(ValueError, match="combine: rows"):
        pk.combine(rows[:, :, :100], w.gathered, w.mla[0], w.idx[0], fmt=fmt)
    with pytest.raises(ValueError, match="row_bytes"):
        pk.combine(rows, w.gathered, w.mla[0], w.idx[0], fmt=pk.CacheFormat("fp8_ds_mla", has_indexer=False))
    with pytest.raises(ValueError, match="combine: slot_mapping"):
        pk.combine(rows, w.gathered[:-1], w.mla[0], w.idx[0], fmt=fmt)
    with pytest.raises(ValueError, match="index_cache is required"):
        pk.combine(rows, w.gathered, w.mla[0], None, fmt=fmt)
    # a format name or None for fmt raised AttributeError (combine, insert, CacheTargets.from_caches)
    with pytest.raises(ValueError, match="combine: fmt = None must be a CacheFormat"):
        pk.combine(rows, w.gathered, w.mla[0], w.idx[0], fmt=None)
    with pytest.raises(ValueError, match=r"CacheTargets.from_caches: fmt = 'fp8' must be a CacheFormat"):
        pk.CacheTargets.from_caches(w.mla, w.idx, "fp8")
    with pytest.raises(ValueError, match="k_scale = nan"):  # the raw op checks what CacheFormat checks
        torch.ops.pcpkv.combine(rows, w.gathered, w.mla[0], w.idx[0], "fp8_ds_mla", "pow2", float("nan"), True)
    with pytest.raises(ValueError, match="k_scale = 1e-45 must be a finite, positive, normal float32"):  # subnormal
        torch.ops.pcpkv.combine(rows, w.gathered, w.mla[0], w.idx[0], "fp8_ds_mla", "pow2", 1e-45, True)
    if device == "cuda":
        # the combine kernel loads rows in 16-byte chunks: a misaligned rows tensor is refused, not launched
        flat = torch.zeros(rows.numel() + 16, dtype=torch.uint8, device=w.device)
        with pytest.raises(ValueError, match="16-byte aligned"):
            pk.combine(flat[4:4 + rows.numel()].view(rows.shape), w.gathered, w.mla[0], w.idx[0], fmt=fmt)
    n = w.M
    kv_c = torch.ones(n, 512, dtype=torch.bfloat16, device=w.device)
    k_pe = torch.ones(n, 64, dtype=torch.bfloat16, device=w.device)
    idx_k = torch.ones(n, 128, dtype=torch.bfloat16, device=w.device)
    slots = w.local[0]["slot_mapping"]
    with pytest.raises(ValueError, match="insert: kv_c"):
        pk.insert(kv_c[:, :500], k_pe, idx_k, slots, w.mla[0], w.idx[0], fmt=fmt)
    with pytest.raises(ValueError, match="insert: index_k"):
        pk.insert(kv_c, k_pe, idx_k[:, :64], slots, w.mla[0], w.idx[0], fmt=fmt)
    with pytest.raises(ValueError, match="index_k is missing"):
        pk.insert(kv_c, k_pe, None, slots, w.mla[0], w.idx[0], fmt=fmt)
    with pytest.raises(ValueError, match="insert: fmt = 'fp8_ds_mla' must be a CacheFormat"):
        pk.insert(kv_c, k_pe, idx_k, slots, w.mla[0], w.idx[0], fmt="fp8_ds_mla")
    with pytest.raises(ValueError, match="insert: slot_mapping"):
        pk.insert(kv_c, k_pe, idx_k, slots.int(), w.mla[0], w.idx[0], fmt=fmt)
    if device == "cuda":
        # MLA rows and indexer slots are two launches: a bad index_k must stop both (checked before either)
        flat = torch.ones(n * 128 + 8, dtype=torch.bfloat16, device=w.device)
        with pytest.raises(ValueError, match="insert: index_k must be 16-byte aligned"):
            pk.insert(kv_c, k_pe, flat[1:1 + n * 128].view(n, 128), slots, w.mla[0], w.idx[0], fmt=fmt)
    with pytest.raises(ValueError, match="barrier_idx"):
        pk.fence(w.fence_state, barrier_idx=2)
    with pytest.raises(ValueError, match="timeout_us"):
        pk.fence(w.fence_state, barrier_idx=0, timeout_us=0)
    # 2**62 us overflowed the deadline (a wait that ended at once, or wrapped on the GPU)
    with pytest.raises(ValueError, match=r"timeout_us = 4611686018427387904 must be in \[1, 86400000000\]"):
        pk.fence(w.fence_state, barrier_idx=0, timeout_us=2**62)
    for kw in ({"timeout_us": True}, {"barrier_idx": True}, {"timeout_us": 2**63}, {"barrier_idx": 2**63}):
        with pytest.raises(ValueError, match="must be an int64 integer"):
            pk.fence(w.fence_state, **{"barrier_idx": 0, **kw})
    assert_nothing_written(w, "combine / insert / fence")
    assert int(w.fence_state.epochs.count_nonzero()) == 0, "a rejected fence advanced an epoch"


def over(buf, like, offset=0):
    """A tensor of like's dtype, shape and strides over the bytes of buf (uint8 [n]) from byte `offset`."""
    v = buf[offset:offset + (buf.numel() - offset) // like.element_size() * like.element_size()].view(like.dtype)
    return torch.as_strided(v, like.shape, like.stride(), v.storage_offset())


def extent(t):
    """Bytes from t's first to just past its last element (csrc/checks.h byte_range)."""
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def end_to_end(*tensors):
    """Contiguous copies of `tensors`, laid end to end in one buffer: each ends exactly where the next begins."""
    nbytes = [t.numel() * t.element_size() for t in tensors]
    buf = torch.empty(sum(nbytes), dtype=torch.uint8, device=tensors[0].device)
    views, at = [], 0
    for t, n in zip(tensors, nbytes):
        views.append(buf[at:at + n].view(t.dtype).view(t.shape))
        views[-1].copy_(t)
        at += n
    for a, b in zip(views, views[1:]):
        assert a.data_ptr() + extent(a) == b.data_ptr(), "the views must touch"
    return views


@pytest.mark.parametrize("device", DEVICES)
def test_combine_insert_refuse_caches_sharing_memory(device):
    """combine and insert read their inputs and write the caches row by row in any order: a cache sharing memory
    with an input or with the other cache was accepted (what lands then depends on that order). Refused naming
    both tensors, before anything is written; views of one buffer that only touch are accepted."""
    plan = small_plan(2)
    fmt = pk.CacheFormat("fp8_ds_mla")
    w = World(plan, fmt, device, seed=5)
    mla, idx, n = w.mla[0], w.idx[0], w.M
    rows = w.staging[0][0, 0]
    kv_c, k_pe, idx_k = (torch.ones(n, d, dtype=torch.bfloat16, device=w.device) for d in (512, 64, 128))
    slots = w.local[0]["slot_mapping"]
    # One buffer with a non-zero pattern behind the overlapping tensors: a write would change it.
    buf = (torch.arange(extent(mla) + extent(rows) + 4096, device=w.device) % 251 + 1).to(torch.uint8)
    shared_mla = over(buf, mla)
    # slot mappings inside a cache hold real slots: without the check the call would write
    shared_gathered, shared_slots = over(buf, w.gathered, 8), over(buf, slots, extent(mla) - 8)
    shared_gathered.copy_(w.gathered)
    shared_slots.copy_(slots)
    before = buf.clone()
    cases = {
        "combine: mla_cache .* index_cache": lambda: pk.combine(rows, w.gathered, shared_mla, over(buf, idx, 4096),
                                                                 fmt=fmt),
        # the last byte of the last slot is the first byte of rows
        "combine: mla_cache .* rows": lambda: pk.combine(over(buf, rows, extent(mla) - 1), w.gathered, shared_mla,
                                                         idx, fmt=fmt),
        "combine: index_cache .* slot_mapping": lambda: pk.combine(rows, shared_gathered, mla,
                                                                   over(buf, idx), fmt=fmt),
        "insert: mla_cache .* index_cache": lambda: pk.insert(kv_c, k_pe, idx_k, slots, shared_mla,
                                                              over(buf, idx, extent(mla) - 132), fmt=fmt),
        "insert: mla_cache .* kv_c": lambda: pk.insert(over(buf, kv_c, 1024), k_pe, idx_k, slots, shared_mla, idx,
                                                       fmt=fmt),
        "insert: index_cache .* index_k": lambda: pk.insert(kv_c, k_pe, over(buf, idx_k, 256), slots, mla,
                                                            over(buf, idx), fmt=fmt),
        "insert: mla_cache .* slot_mapping": lambda: pk.insert(kv_c, k_pe, idx_k, shared_slots, shared_mla, idx,
                                                               fmt=fmt),
    }
    for names, call in cases.items():
        a, b = names.split(" .* ")
        with pytest.raises(ValueError, match=rf"{a} \(.*\) shares memory with {b} \("):
            call()
        if w.device.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(buf, before), f"{names}: the shared buffer was written"
        assert_nothing_written(w, names)

    # Adjacent views: inputs ending where a cache begins, the two caches end to end. Each call must be accepted and
    # write what it writes into separate tensors.
    for r in range(w.W):
        w.dispatch(r, row_dests=w.dests[r])
    pk.fence(w.fence_state, 0, written=w.staging)
    rows_a, mla_a, idx_a, slots_a = end_to_end(rows, mla, idx, w.gathered)
    pk.combine(rows_a, slots_a, mla_a, idx_a, fmt=fmt)
    pk.combine(rows, w.gathered, mla, idx, fmt=fmt)
    assert bool((mla != GUARD).any()) and bool((idx != GUARD).any()), "combine wrote nothing to compare"
    assert torch.equal(mla_a, mla) and torch.equal(idx_a, idx), "combine over adjacent views"
    w.poison()
    loc = w.local[0]
    kv_a, mla_a, idx_a, k_pe_a, idx_k_a, slots_a = end_to_end(loc["kv"], mla, idx, loc["k_pe"], loc["index_k"], slots)
    pk.insert(kv_a, k_pe_a, idx_k_a, slots_a, mla_a, idx_a, fmt=fmt)
    pk.insert(loc["kv"], loc["k_pe"], loc["index_k"], slots, mla, idx, fmt=fmt)
    assert bool((mla != GUARD).any()) and bool((idx != GUARD).any()), "insert wrote nothing to compare"
    assert torch.equal(mla_a, mla) and torch.equal(idx_a, idx), "insert over adjacent views"


def test_plan_refuses_positions_past_the_model():
    # DeepSeek-V3.2: max_position_embeddings 163840 (its HF config); positions 0..163839 are the model's.
    reqs = [pk.Request(200000), pk.Request(1, 9, decode=True)]
    with pytest.raises(ValueError, match=r"requests\[0\] \(prefill of 200000 tokens from position 0\) reaches "
                                         r"position 163840, but max_position_embeddings is 163840"):
        pk.make_plan(8, reqs, max_position_embeddings=163840)
    with pytest.raises(ValueError, match=r"requests\[1\] \(decode at position 163840\) reaches position 163840"):
        pk.make_plan(2, [pk.Request(5), pk.Request(1, 163840, decode=True)], max_position_embeddings=163840)
    # The boundary: the last position allowed, and no argument (no check) for the same batch.
    ok = pk.make_plan(2, [pk.Request(16, 163824)], block_size=16, max_position_embeddings=163840)
    assert int(ok.global_positions.max()) == 163839
    assert int(pk.make_plan(2, reqs).global_positions.max()) == 199999
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_position_embeddings"):
            pk.make_plan(2, [pk.Request(5)], max_position_embeddings=bad)
    spec = pk.ModelSpec.from_hf_config({"model_type": "deepseek_v32", "q_lora_rank": 1536,
                                        "max_position_embeddings": 163840})
    assert spec.max_position_embeddings == 163840


def test_host_side_errors():
    with pytest.raises(ValueError, match="kv_format"):
        pk.CacheFormat("fp4")
    # k_scale: a finite positive normal float32 (the subnormals 1e-45 and 1e-39 and 1e300, inf as float32, passed)
    for bad in (1e-45, 1e-39, 0.0, -1.0, float("nan"), float("inf"), 1e300):
        with pytest.raises(ValueError, match=re.escape(f"k_scale = {bad!r} must be a finite, positive, normal float32")):
            pk.CacheFormat("fp8", k_scale=bad)
    with pytest.raises(ValueError, match="k_scale = '0.5' must be a number"):  # was a TypeError
        pk.CacheFormat("fp8", k_scale="0.5")
    for ok in (2.0 ** -126, 0.05, 1, 3.4e38):
        assert pk.CacheFormat("fp8", k_scale=ok).k_scale == ok
    with pytest.raises(ValueError, match="block-size|block_size"):
        pk.make_plan(2, [pk.Request(5)], block_size=12)
    # PlanConfig's int32 fields: 2^32 + 2 ranks made a plan of 2 ranks, a block_size of 2^32 + 16 one of 16 slots
    # per block (while PcpPlan kept the given numbers, so num_slots was wrong), 2^31 was called -2147483648
    for world, block_size, what in ((2 ** 32 + 2, 64, "pcp_world = 4294967298"),
                                    (2, 2 ** 31, "block_size = 2147483648"),
                                    (2, 2 ** 32 + 16, "block_size = 4294967312")):
        with pytest.raises(ValueError, match=f"make_plan: {what} is out of the int32 range"):
            pk.make_plan(world, [pk.Request(8)], block_size=block_size)
    plan = small_plan(2)
    bad = plan.slot_mapping[0].clone()
    bad[3] = plan.num_slots + 5
    with pytest.raises(ValueError, match=r"slot_mapping\[3\] = .* out of range"):
        pk.validate_slots(bad, plan.num_slots)
    # the ops' int64 [T] only: float slots (0.5, 1.5) passed the range checks, a list had no .detach
    for wrong in (torch.tensor([0.5, 1.5]), plan.slot_mapping[0].int(), plan.slot_mapping[0][None], [0, 1]):
        with pytest.raises(ValueError, match=r"slot_mapping: expected an int64 \[num_tokens\] tensor"):
            pk.validate_slots(wrong, plan.num_slots)


def test_model_spec_errors_name_the_key():
    """Issue 12: a missing or mistyped key raised TypeError / a bare int() error, or passed (a string eps)."""
    base = {"model_type": "deepseek_v32", "q_lora_rank": 1536, "rope_theta": 10000}
    assert pk.ModelSpec.from_hf_config(base).q_lora_rank == 1536
    cases = [
        ({"q_lora_rank": None}, "q_lora_rank is missing"),
        ({"q_lora_rank": "1536"}, r"q_lora_rank = '1536' must be an integer"),
        ({"q_lora_rank": [1536]}, r"q_lora_rank = \[1536\] must be an integer"),
        ({"q_lora_rank": 1536.5}, r"q_lora_rank = 1536.5 must be an integer"),
        ({"q_lora_rank": True}, "q_lora_rank = True"),
        ({"q_lora_rank": 1500}, "q_lora_rank = 1500 must be a multiple of 8"),
        ({"kv_lora_rank": "512"}, "kv_lora_rank = '512'"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps = '1e-6' must be a number"),
        ({"rms_norm_eps": 0}, r"rms_norm_eps = 0.0 must be in \(0, 1\)"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps = nan must be finite"),
        ({"index_topk": 0}, "index_topk = 0 must be >= 1"),
        ({"index_topk_freq": "4"}, "index_topk_freq = '4'"),
        ({"index_skip_topk_offset": -1}, "index_skip_topk_offset = -1"),
        ({"num_hidden_layers": 0}, "num_hidden_layers = 0"),
        ({"rope_interleave": "yes"}, "rope_interleave = 'yes' must be true or false"),
        ({"indexer_types": "full"}, "indexer_types = 'full'"),
        ({"indexer_types": ["full", 3]}, r"indexer_types\[1\] = 3"),
        ({"rope_theta": -1}, r"rope_theta\) = -1.0 must be in \(1, 1e\+12\]"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"rope_theta": "1e4"}, "rope_theta = '1e4' must be a number"),
        ({"rope_scaling": [40]}, "rope_scaling = \\[40\\] must be a dict"),
        ({"rope_scaling": {"type": "yarn", "factor": "40"}}, "rope_scaling.factor = '40' must be a number"),
        ({"rope_scaling": {"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096}},
         "factor = 0.5 must be in"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096.5}},
         "rope_parameters.original_max_position_embeddings = 4096.5 must be an integer"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                              "beta_fast": 1, "beta_slow": 32}}, "beta_fast = 1.0 is less than"),
        # HF transformers requires both for YaRN; pcpkv took 1.0 and 4096 without a word
        ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}},
         "rope_scaling.factor is missing from the HF config"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 40}},
         "rope_parameters.original_max_position_embeddings is missing from the HF config"),
        ({"rope_parameters": {"rope_type": 7}}, "rope_parameters.rope_type = 7 must be a string"),
    ]
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            pk.ModelSpec.from_hf_config({**base, **over})

    class Config:  # a transformers config object: attributes instead of keys
        model_type, q_lora_rank, rope_theta = "glm_moe_dsa", "2048", 8e6

    with pytest.raises(ValueError, match="q_lora_rank = '2048'"):
        pk.ModelSpec.from_hf_config(Config())
    with pytest.raises(ValueError, match="config = 5"):
        pk.ModelSpec.from_hf_config(5)


def test_rope_table_errors_name_the_argument():
    """Issue 12: rope_theta <= 0 returned NaN rows, 2^40 positions raised std::bad_alloc."""
    assert bool(torch.isfinite(pk.rope_table(pk.RopeSpec(), 16)).all())
    for theta in (-1.0, 0.0, 1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rope_theta"):
            pk.RopeSpec("default", theta)
    with pytest.raises(ValueError, match="scaling"):
        pk.RopeSpec("linear")
    for n in (0, -5, 2 ** 40, 16.0, True, "16"):
        with pytest.raises(ValueError, match="num_positions"):
            pk.rope_table(pk.RopeSpec(), n)
    with pytest.raises(ValueError, match="RopeSpec"):
        pk.rope_table({"theta": 1e4}, 16)
    # the op itself (torch.ops.pcpkv.rope_table), which callers may reach without RopeSpec
    op = torch.ops.pcpkv.rope_table
    yarn = ("deepseek_yarn", 1e4, 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"rope_table: rope_theta = -1 must be in \(1"):
        op(16, "default", -1.0, 1.0, 4096, 32.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="rope_table: rope_theta = nan"):
        op(16, "default", float("nan"), 1.0, 4096, 32.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="rope_table: num_positions = 1099511627776 exceeds 2\\^28"):
        op(2 ** 40, "default", 1e4, 1.0, 4096, 32.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="rope_table: factor = nan"):
        op(16, yarn[0], yarn[1], float("nan"), *yarn[3:])
    with pytest.raises(ValueError, match="rope_table: beta_fast = 1 is less than beta_slow = 32"):
        op(16, *yarn[:4], 1.0, 32.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="rope_table: original_max_position_embeddings = 0"):
        op(16, *yarn[:3], 0, *yarn[4:])
    assert bool(torch.isfinite(op(16, *yarn)).all())


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_refuses_a_tensor_on_another_device(device):
    """One tensor on the meta device among CPU (or CUDA) tensors made the dispatcher pick the ops' meta kernel (the
    fake of _fake.py): the call did nothing and raised nothing. Every tensor argument must be on kv's device (host
    tables on the CPU, `written` on kv's device type): refused naming the argument and its device, nothing written.
    All-meta calls (meta tracing) and FakeTensor tracing still pass."""
    w = World(small_plan(2), pk.CacheFormat("fp8_ds_mla"), device, seed=3)
    loc, wt, fmt = w.local[0], w.weights, w.fmt
    dev = str(w.device) if w.device.type == "cpu" else f"{w.device.type}:{w.device.index or 0}"

    def kwargs(**over):
        a = dict(kv=loc["kv"], k_pe=loc["k_pe"], positions=loc["positions"], kv_norm_w=wt["kv_norm_w"],
                 rope_cos_sin=w.rope_cos_sin, fmt=fmt, q_c=loc["q_c"], q_norm_w=wt["q_norm_w"],
                 q_c_out=loc["q_c_out"], index_k=loc["index_k"], index_ln_w=wt["index_ln_w"],
                 index_ln_b=wt["index_ln_b"], slot_mapping=loc["slot_mapping"], targets=w.targets,
                 row_dests=w.dests[0], topk_fill=loc["topk"])
        a.update(over)
        return a

    meta = lambda t: t.to("meta")  # noqa: E731
    cases = [(dict(kv_norm_w=meta(wt["kv_norm_w"])), f"kv_norm_w is on meta but kv on {dev}: every tensor"),
             (dict(k_pe=meta(loc["k_pe"])), f"k_pe is on meta but kv on {dev}"),
             (dict(rope_cos_sin=meta(w.rope_cos_sin)), f"rope_cos_sin is on meta but kv on {dev}"),
             (dict(slot_mapping=meta(loc["slot_mapping"])), f"slot_mapping is on meta but kv on {dev}"),
             (dict(q_c_out=meta(loc["q_c_out"])), f"q_c_out is on meta but kv on {dev}"),
             (dict(index_ln_b=meta(wt["index_ln_b"])), f"index_ln_b is on meta but kv on {dev}"),
             (dict(targets=pk.CacheTargets(w.targets.host.to("meta"), w.targets.table, w.targets.tensors)),
              "targets_host is on meta: it is a host copy, which must be on the CPU"),
             (dict(written=[meta(w.mla[0])]), rf"written\[0\] is on meta but kv on {dev}"),
             # the reference itself on meta: the first other tensor is named
             (dict(kv=meta(loc["kv"])), f"k_pe is on {dev} but kv on meta")]
    for over, match in cases:
        with pytest.raises(ValueError, match=rf"dispatch: {match}"):
            pk.dispatch(**kwargs(**over))
        assert_nothing_written(w, match)
    # the raw op too (a meta kv_norm_w given positionally)
    with pytest.raises(ValueError, match="dispatch: kv_norm_w is on meta"):
        torch.ops.pcpkv.dispatch(loc["kv"], loc["k_pe"], loc["positions"], meta(wt["kv_norm_w"]), w.rope_cos_sin,
                                 None, None, None, None, None, None, None, None, None, None, None, None, None, None,
                                 None, [], "fp8_ds_mla", "pow2", 1.0, False, 1e-6, 1e-6, 1e-6, True, False, False)
    # another real device type in `written` (the tensors declared mutated): refused by the real op as well
    if device == "cuda":
        with pytest.raises(ValueError, match=r"dispatch: written\[0\] is on cpu but kv on cuda"):
            pk.dispatch(**kwargs(written=[torch.zeros(4)]))
    else:
        with pytest.raises(ValueError, match=r"dispatch: written\[0\] is on meta but kv on cpu"):
            pk.dispatch(**kwargs(written=[torch.zeros(4, device="meta")]))
    assert_nothing_written(w, "written on another device")
    # combine / insert / fence: the same rule
    with pytest.raises(ValueError, match=f"combine: slot_mapping is on meta but mla_cache on {dev}"):
        pk.combine(w.staging[0][0, 0], meta(w.gathered), w.mla[0], w.idx[0], fmt=fmt)
    with pytest.raises(ValueError, match=f"insert: kv_c is on meta but mla_cache on {dev}"):
        pk.insert(meta(loc["kv"]), loc["k_pe"], loc["index_k"], loc["slot_mapping"], w.mla[0], w.idx[0], fmt=fmt)
    with pytest.raises(ValueError, match=r"fence: written\[0\] is on meta"):
        pk.fence(w.fence_state, 0, written=[meta(w.staging[0])])
    assert_nothing_written(w, "combine / insert / fence with a meta tensor")
    assert int(w.fence_state.epochs.count_nonzero()) == 0, "a rejected fence advanced an epoch"

    # Meta tracing: every tensor on meta (the table's host copy on the CPU, as a real call has it) passes and does
    # nothing.
    all_meta = {k: (meta(v) if isinstance(v, torch.Tensor) else v)
                for k, v in kwargs(row_dests=None).items()}
    all_meta["targets"] = pk.CacheTargets(w.targets.host, meta(w.targets.table), [meta(t) for t in w.targets.tensors])
    assert pk.dispatch(**all_meta) is None
    # FakeTensor tracing (torch.compile's): FakeTensors report the devices they stand for
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
            for k, v in kwargs(targets=None, row_dests=None).items()}
    fake_meta_w = mode.from_tensor(meta(wt["kv_norm_w"]))
    with mode:
        pk.dispatch(**fake)
        with pytest.raises(ValueError, match=f"dispatch: kv_norm_w is on meta but kv on {dev}"):
            pk.dispatch(**{**fake, "kv_norm_w": fake_meta_w})


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_refuses_non_float_weights(device):
    """A complex kv_norm_w lost its imaginary part and an integer or bool weight was cast to float32 silently: the
    norm weights must be floating point (float32, bf16 and fp16 convert exactly), refused naming the argument."""
    w = World(small_plan(2), pk.CacheFormat("fp8_ds_mla"), device, seed=3)
    loc, wt = w.local[0], w.weights

    def call(match, **over):
        a = dict(kv=loc["kv"], k_pe=loc["k_pe"], positions=loc["positions"], kv_norm_w=wt["kv_norm_w"],
                 rope_cos_sin=w.rope_cos_sin, fmt=w.fmt, q_c=loc["q_c"], q_norm_w=wt["q_norm_w"],
                 q_c_out=loc["q_c_out"], index_k=loc["index_k"], index_ln_w=wt["index_ln_w"],
                 index_ln_b=wt["index_ln_b"], slot_mapping=loc["slot_mapping"], targets=w.targets,
                 row_dests=w.dests[0], topk_fill=loc["topk"])
        a.update(over)
        with pytest.raises(ValueError, match=match):
            pk.dispatch(**a)
        assert_nothing_written(w, match)

    call(r"dispatch: kv_norm_w: expected a floating-point weight .* got torch.complex64 \[512\]",
         kv_norm_w=wt["kv_norm_w"].to(torch.complex64))
    call(r"dispatch: kv_norm_w: .* got torch.int64", kv_norm_w=torch.ones(512, dtype=torch.long, device=w.device))
    call(r"dispatch: q_norm_w: .* got torch.int32", q_norm_w=wt["q_norm_w"].int())
    call(r"dispatch: index_ln_w: .* got torch.bool", index_ln_w=wt["index_ln_w"] > 0)
    call(r"dispatch: index_ln_b: .* got torch.uint8", index_ln_b=wt["index_ln_b"].to(torch.uint8))
    call(r"dispatch: kv_norm_w: .* got list", kv_norm_w=[1.0] * 512)
    # floating weights of other widths still convert: a bf16 weight writes what its float32 value writes
    bf16 = {k: v.bfloat16() for k, v in wt.items()}
    w.weights = {k: v.float() for k, v in bf16.items()}
    w.dispatch(0, targets=w.targets)
    want = [t.clone() for t in w.replica_bytes(0)]
    w.poison()
    w.weights = bf16
    w.dispatch(0, targets=w.targets)
    for a, b in zip(w.replica_bytes(0), want):
        assert torch.equal(a, b), "a bf16 norm weight wrote other bytes than its float32 value"


def test_model_spec_max_position_embeddings():
    """max_position_embeddings was int(x or 0): 'abc', [1], inf, -5, 2.5, True and 10**30 were accepted (or raised
    TypeError / OverflowError). Now an integer in [1, 2^63 - 1] (the C++ loader's int64 field and range check);
    absent or null: 0 (unknown)."""
    base = {"model_type": "deepseek_v32", "q_lora_rank": 1536}
    spec = lambda **kv: pk.ModelSpec.from_hf_config({**base, **kv})  # noqa: E731
    for bad, match in [("abc", "= 'abc' must be an integer"), ([1], r"= \[1\] must be an integer"),
                       (float("inf"), "= inf must be finite"), (float("nan"), "= nan must be finite"),
                       (-5, r"= -5 must be in \[1, 2\^63 - 1\]"), (0, r"= 0 must be in \[1"),
                       (2.5, "= 2.5 must be an integer"), (True, "= True must be an integer"),
                       (10 ** 30, rf"= {10 ** 30} must be in \[1, 2\^63 - 1\]"),
                       (2 ** 63, rf"= {2 ** 63} must be in \[1"),
                       (1e30, r"= 1e\+30 must be in \[1, 2\^63 - 1\] \(the C\+\+ loader")]:
        with pytest.raises(ValueError, match=f"max_position_embeddings {match}"):
            spec(max_position_embeddings=bad)
    assert spec(max_position_embeddings=163840).max_position_embeddings == 163840
    assert spec(max_position_embeddings=4096.0).max_position_embeddings == 4096
    assert spec(max_position_embeddings=2 ** 63 - 1).max_position_embeddings == pk.model.MAX_POSITION_EMBEDDINGS
    assert spec().max_position_embeddings == 0 and spec(max_position_embeddings=None).max_position_embeddings == 0


def test_model_spec_indexer_types_rope_theta_and_cache_format():
    """indexer_types of the wrong length passed and layer_has_indexer raised a bare IndexError; a top-level
    rope_theta that rope_parameters overrode vanished without a word (the CLI prints a note); CacheFormat took
    has_indexer='no' (truthy)."""
    base = {"model_type": "glm_moe_dsa", "q_lora_rank": 2048}
    with pytest.raises(ValueError, match=r"indexer_types has 2 entries but num_hidden_layers = 3: expected one"):
        pk.ModelSpec.from_hf_config({**base, "num_hidden_layers": 3, "indexer_types": ["full", "shared"]})
    with pytest.raises(ValueError, match=r"indexer_types has 4 entries but num_hidden_layers = 3"):
        pk.ModelSpec("glm_moe_dsa", 2048, 1e-5, pk.RopeSpec(), num_hidden_layers=3,
                     indexer_types=("full", "shared", "shared", "full"))
    ok = pk.ModelSpec.from_hf_config({**base, "num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]})
    assert [ok.layer_has_indexer(i) for i in range(3)] == [True, False, True]
    unknown = pk.ModelSpec.from_hf_config({**base, "indexer_types": ["full", "shared"]})  # no num_hidden_layers
    with pytest.raises(ValueError, match=r"layer_idx = 2 has no entry in indexer_types \(size 2\)"):
        unknown.layer_has_indexer(2)
    with pytest.raises(ValueError, match="layer_idx = -1 must be an integer >= 0"):
        unknown.layer_has_indexer(-1)

    with pytest.warns(UserWarning, match=re.escape("top-level 'rope_theta' = 10000 is shadowed by "
                                                   "'rope_parameters.rope_theta' = 1000000.0: using 1000000.0")):
        s = pk.ModelSpec.from_hf_config({**base, "rope_theta": 10000,
                                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert s.rope.theta == 1e6
    with pytest.warns(UserWarning, match="'rope_scaling.rope_theta' = 50000.0"):
        pk.ModelSpec.from_hf_config({**base, "rope_theta": 1e4, "rope_scaling": {"type": "default",
                                                                                 "rope_theta": 5e4}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # equal values, or only one of them: no warning
        pk.ModelSpec.from_hf_config({**base, "rope_theta": 1e6, "rope_parameters": {"rope_theta": 1000000}})
        pk.ModelSpec.from_hf_config({**base, "rope_parameters": {"rope_theta": 1e6}})
        assert pk.ModelSpec.from_hf_config({**base, "rope_theta": 5e5}).rope.theta == 5e5
    with pytest.raises(ValueError, match="rope_theta = 'x' must be a number"):  # the shadowed key is still typed
        pk.ModelSpec.from_hf_config({**base, "rope_theta": "x", "rope_parameters": {"rope_theta": 1e6}})

    for bad in ("no", 1, 0, None, "False"):
        with pytest.raises(ValueError, match=re.escape(f"has_indexer = {bad!r} must be True or False")):
            pk.CacheFormat("fp8_ds_mla", has_indexer=bad)
    assert pk.CacheFormat("fp8", has_indexer=False).row_bytes == 576


def test_rope_choice_follows_transformers_when_both_keys_are_given():
    """A raw config dict with rope_scaling and rope_parameters: transformers 5 keeps `rope_scaling or
    rope_parameters` (an empty rope_scaling gives way); pcpkv's RopeSpec must read the same dict (it read
    rope_parameters first, so a file with both could rotate k_pe with another table than the model)."""
    transformers = pytest.importorskip("transformers")
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    plain = {"rope_type": "default", "rope_theta": 50000.0}
    for scaling, parameters in ((yarn, plain), (plain, yarn), ({}, yarn), (None, yarn)):
        raw = {"rope_scaling": scaling, "rope_parameters": parameters}
        hf = transformers.DeepseekV32Config(**{k: v for k, v in raw.items() if v is not None})
        want = pk.RopeSpec.from_hf(hf)
        assert pk.RopeSpec.from_hf(raw) == want, (scaling, parameters)
        assert want.scaling == ("deepseek_yarn" if (scaling or parameters) is yarn else "default")


def test_absent_rms_norm_eps_is_the_model_types_transformers_default():
    """GLM-5's config class defaults rms_norm_eps to 1e-5; pcpkv took 1e-6 for a config dict without the key
    (other q_c_out / kv_c values than the model, and than the C++ loader's glm-5 preset)."""
    transformers = pytest.importorskip("transformers")
    for model_type, cls in (("glm_moe_dsa", transformers.GlmMoeDsaConfig),
                            ("deepseek_v32", transformers.DeepseekV32Config)):
        spec = pk.ModelSpec.from_hf_config({"model_type": model_type, "q_lora_rank": 1536})
        assert spec.rms_norm_eps == cls().rms_norm_eps, model_type


@pytest.mark.parametrize("device", DEVICES)
def test_indexer_cache_of_another_block_size_is_refused(device):
    """combine and insert wrote an indexer cache [16, 8, 132] next to an MLA cache [8, 16, 656] (a slot's indexer
    row then sits in another block than its MLA row); the cache tables already refused it."""
    fmt = pk.CacheFormat("fp8_ds_mla", has_indexer=True)
    mla = pk.allocate_mla_cache(8, 16, "fp8_ds_mla", device, fill=0xA5)
    idx = pk.allocate_indexer_cache(16, 8, device, fill=0xA5)
    before = (mla.clone(), idx.clone())
    n = 4
    slots = torch.arange(n, dtype=torch.int64, device=device) + 16
    bf = lambda w: torch.ones(n, w, dtype=torch.bfloat16, device=device)  # noqa: E731
    rows = torch.zeros(1, n, fmt.row_bytes, dtype=torch.uint8, device=device)
    match = r"target: indexer cache block_size = 8 differs from the MLA cache's 16"
    with pytest.raises(ValueError, match="insert: " + match):
        pk.insert(bf(512), bf(64), bf(128), slots, mla, idx, fmt=fmt)
    with pytest.raises(ValueError, match="combine: " + match):
        pk.combine(rows, slots, mla, idx, fmt=fmt)
    assert torch.equal(mla, before[0]) and torch.equal(idx, before[1])
