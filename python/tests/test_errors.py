"""Bad arguments raise ValueError naming the argument before anything is written or launched, on every device.

The first test checks the error path itself on the CPU: a C++ exception leaving pcpkv_torch._C (a translated
pcpkv::Error and a TORCH_CHECK_VALUE) arrives in Python as ValueError. run_device_tests.sh runs this file
first, in its own process, so a broken error path shows up here by name instead of as a crash elsewhere.

After every rejected call the caches still hold only guard bytes, the staging buffers only zeros and the
outputs only their poison: nothing was written (on CUDA: checked after a synchronize, so nothing was
launched that wrote either)."""

import pytest

from helpers import DEVICES, GUARD, POISON_I32, World, pk, torch


def small_plan(world, seed=0):
    reqs = [pk.Request(37, 0), pk.Request(50, 11), pk.Request(1, 20, decode=True), pk.Request(1, 5, decode=True)]
    return pk.make_plan(world, reqs, block_size=16, extra_blocks=2, seed=seed)


def test_cpp_errors_reach_python_as_value_error():
    # pcpkv::Error thrown in pcpkv's core, translated to ValueError by csrc/common.h translate_errors
    with pytest.raises(ValueError, match="num_positions = 0"):
        torch.ops.pcpkv.rope_table(0, "default", 10000.0, 1.0, 4096, 32.0, 1.0, 1.0, 1.0)
    # TORCH_CHECK_VALUE of the tensor checks (csrc/common.cpp), CPU tensors
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
    call("k_pe: expected bfloat16", k_pe=loc["k_pe"][:, :32])
    call("positions: expected", positions=loc["positions"].int())
    call("kv_norm_w: expected", kv_norm_w=wt["kv_norm_w"][:256])
    call("rope_cos_sin: expected", rope_cos_sin=w.rope_cos_sin[:, :32])
    call("q_c and q_c_out go together", q_c_out=None)
    call("q_norm_w", q_norm_w=wt["q_norm_w"][:8])
    call("index_k, index_ln_w and index_ln_b are required", index_k=None)
    call("index_k / index_k_out given but has_indexer=False", fmt=pk.CacheFormat("fp8_ds_mla", has_indexer=False),
         row_dests=None)
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
    # a table whose geometry can not hold the format's rows (bf16 rows are wider than fp8_ds_mla's)
    call("row_stride|smaller", fmt=pk.CacheFormat("bf16"), row_dests=None)
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
    with pytest.raises(ValueError, match="k_scale = nan"):  # the raw op checks what CacheFormat checks
        torch.ops.pcpkv.combine(rows, w.gathered, w.mla[0], w.idx[0], "fp8_ds_mla", "pow2", float("nan"), True)
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
    assert_nothing_written(w, "combine / insert / fence")
    assert int(w.fence_state.epochs.count_nonzero()) == 0, "a rejected fence advanced an epoch"


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
    with pytest.raises(ValueError, match="block-size|block_size"):
        pk.make_plan(2, [pk.Request(5)], block_size=12)
    plan = small_plan(2)
    bad = plan.slot_mapping[0].clone()
    bad[3] = plan.num_slots + 5
    with pytest.raises(ValueError, match=r"slot_mapping\[3\] = .* out of range"):
        pk.validate_slots(bad, plan.num_slots)
