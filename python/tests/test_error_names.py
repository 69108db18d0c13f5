"""Errors name what the Python caller passed: the plan's refusals name make_plan's arguments (pcp_world, block_size;
they named only the CLI's --pcp / --block-size), and a kv / k_pe row-count mismatch names both tensors with their
rows and the local tokens positions / slot_mapping count, blaming the one that differs (a short kv was blamed on
k_pe). Nothing is written by a refused call."""

import re

import pytest

from helpers import DEVICES, GUARD, World, pk, torch


@pytest.mark.parametrize("call", ["make_plan", "op"])
def test_plan_errors_name_pcp_world_and_block_size(call):
    def plan(pcp_world, block_size):
        if call == "make_plan":
            return pk.make_plan(pcp_world, [pk.Request(12)], block_size=block_size)
        return torch.ops.pcpkv.make_plan(pcp_world, block_size, [0], [12], [0], 0, True, True, 0, "request",
                                         "replicated")

    for args, message in (((0, 16), "pcp_world (--pcp) = 0 must be >= 1"),
                          ((2000, 16), "pcp_world (--pcp) = 2000 is larger than 1024"),
                          ((2, 12), "block_size (--block-size) = 12 must be a power of two")):
        with pytest.raises(ValueError, match=re.escape(message)):
            plan(*args)


def small_world(device):
    reqs = [pk.Request(37, 0), pk.Request(50, 11), pk.Request(1, 20, decode=True)]
    plan = pk.make_plan(2, reqs, block_size=16, extra_blocks=2, seed=5)
    return World(plan, pk.CacheFormat("fp8_ds_mla"), device, seed=6)


def untouched(w):
    if w.device.type == "cuda":
        torch.cuda.synchronize()
    return all(bool((w.flat(c) == GUARD).all()) for c in w.mla + w.idx)


def row_cases(T, kv_name):
    """(kv rows, k_pe rows, the message) for each way the two can disagree with the T local tokens."""
    return [(T - 1, T, rf"{kv_name} has {T - 1} rows, expected {T} \(the local tokens: REF has {T}\); k_pe has {T}$"),
            (T + 1, T + 1, rf"REF: expected contiguous Long \[{T + 1}\]"),  # the two agree: the reference is odd
            (T, T + 2, rf"k_pe has {T + 2} rows, expected {T} \(the local tokens: REF has {T}\); {kv_name} has {T}$"),
            (T - 1, T + 2, rf"{kv_name} and k_pe have {T - 1} and {T + 2} rows, expected {T} "
                           rf"\(the local tokens: REF has {T}\)$")]


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_kv_k_pe_rows_blame_the_one_positions_disagrees_with(device):
    w = small_world(device)
    loc, wt, M = w.local[0], w.weights, w.M
    gen = torch.Generator().manual_seed(8)
    for kv_rows, k_pe_rows, message in row_cases(M, "kv"):
        kv = torch.randn(kv_rows, 512, generator=gen).to(torch.bfloat16).to(w.device)
        k_pe = torch.randn(k_pe_rows, 64, generator=gen).to(torch.bfloat16).to(w.device)
        with pytest.raises(ValueError, match="dispatch: " + message.replace("REF", "positions")):
            pk.dispatch(kv, k_pe, loc["positions"], wt["kv_norm_w"], w.rope_cos_sin, fmt=w.fmt, q_c=loc["q_c"],
                        q_norm_w=wt["q_norm_w"], q_c_out=loc["q_c_out"], index_k=loc["index_k"],
                        index_ln_w=wt["index_ln_w"], index_ln_b=wt["index_ln_b"], slot_mapping=loc["slot_mapping"],
                        targets=w.targets)
        assert untouched(w), message


@pytest.mark.parametrize("device", DEVICES)
def test_insert_kv_c_k_pe_rows_blame_the_one_slot_mapping_disagrees_with(device):
    w = small_world(device)
    slots = w.local[0]["slot_mapping"]
    n = slots.numel()
    gen = torch.Generator().manual_seed(9)
    idx_k = torch.randn(n, 128, generator=gen).to(torch.bfloat16).to(w.device)
    for kv_rows, k_pe_rows, message in row_cases(n, "kv_c"):
        kv_c = torch.randn(kv_rows, 512, generator=gen).to(torch.bfloat16).to(w.device)
        k_pe = torch.randn(k_pe_rows, 64, generator=gen).to(torch.bfloat16).to(w.device)
        with pytest.raises(ValueError, match="insert: " + message.replace("REF", "slot_mapping")):
            pk.insert(kv_c, k_pe, idx_k, slots, w.mla[0], w.idx[0], fmt=w.fmt)
        assert untouched(w), message
