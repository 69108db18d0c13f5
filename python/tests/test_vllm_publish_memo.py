"""VllmPcpPublisher.publish's memo (issue 35 item 4): a layer's weights and cos/sin tables are checked and converted
once per tensor and stamp, the rest of a call every time. A second call with another tensor (other data_ptr, shape,
dtype, a slot mapping of another length, an indexer slot mapping where there was none) is checked again and refused
when bad, naming the argument, before anything is written; new values are used, also when a freed tensor's memory
is reused by another or `t.data = x` swaps a tensor's storage. Every transport, with and without the per-call
exchange (one rank: the memo is per rank).

    cd python && pytest tests/test_vllm_publish_memo.py -q
"""

import numpy as np
import pytest

from helpers import pk, torch  # noqa: F401
from dist_ranks import run_ranks

TRANSPORTS = ("direct", "staging", "collect")

# case -> (the argument changed, the words its refusal must hold)
REFUSALS = {
    "q_rms_norm_w dtype": ["q_rms_norm_w", "floating-point"],
    "kv_rms_norm_w shape": ["kv_rms_norm_w", "[512]"],
    "k_rope_cos_sin_cache shape": ["k_rope_cos_sin_cache", "[max_position, 64]"],
    "index table values": ["index_k_rope_cos_sin_cache", "same values"],
    "q_c width": ["q_rms_norm_w", "[56]"],
    "kv_c dtype": ["kv_c", "bf16"],
    "k_pe rows": ["k_pe", "T = "],
    "slot_mapping length": ["slot_mapping", ">= W * T"],
    "indexer_slot_mapping given": ["indexer_slot_mapping", "int64"],
    "topk_indices_buffer rows": ["topk_indices_buffer", ">= T"],
    "weight dtype by .data": ["q_rms_norm_w", "floating-point"],
}


def _memo_run(rank, world, check):
    import test_vllm_publish as vp
    from pcpkv_torch.vllm import VllmPcpPublisher

    got = {}
    rows, sm, nd = vp.vllm_step(world, vp.STEPS[1], vp._blocks())
    x = vp.Inputs(0, True)
    pos, qkv, ik = x.rows(rows[rank], 7)
    q_c, kv, pe = vp._splits(qkv)
    M = len(rows[0])
    for transport in TRANSPORTS:
        mla, idx = vp._engine_caches("fp8_ds_mla", "cpu", True)
        pub = VllmPcpPublisher(mla, idx, kv_cache_dtype="fp8_ds_mla", max_num_tokens=48, transport=transport,
                               check=check)
        topk = torch.zeros((M, vp.TOPK), dtype=torch.int32)
        base = dict(positions=pos, q_c=q_c, q_w=x.w["q"], kv_c=kv, kv_w=x.w["kv"], k_pe=pe, table=x.cos_sin,
                    index_table=x.cos_sin.clone(), topk=topk, sm=sm, ism=None)

        def call(**kw):
            a = dict(base, **kw)
            return pub.publish(0, a["positions"], a["q_c"], a["q_w"], 1e-6, a["kv_c"], a["kv_w"], 1e-6, a["k_pe"],
                               a["table"], ik, x.w["ln_w"], x.w["ln_b"], 1e-6, a["index_table"], a["topk"], a["sm"],
                               nd, indexer_slot_mapping=a["ism"]).clone()

        def refused(case, **kw):
            before = [vp._flat(t).clone() for t in mla + [idx[0]]]
            try:
                call(**kw)
                got[(transport, case)] = "published"
            except ValueError as e:
                written = any(not torch.equal(vp._flat(t), b) for t, b in zip(mla + [idx[0]], before))
                got[(transport, case)] = str(e) + (" [WRITTEN]" if written else "")

        good = call()
        got[(transport, "again")] = torch.equal(call(), good)  # a memo hit publishes the same
        refused("q_rms_norm_w dtype", q_w=x.w["q"].to(torch.int32))
        refused("kv_rms_norm_w shape", kv_w=torch.ones(256, dtype=torch.bfloat16))
        refused("k_rope_cos_sin_cache shape", table=x.cos_sin[:, :32])  # the same data_ptr, another shape
        refused("index table values", index_table=x.cos_sin * 2)
        refused("q_c width", q_c=qkv[:, :vp.Q_LORA - 8])
        refused("kv_c dtype", kv_c=kv.float())
        refused("k_pe rows", k_pe=pe[:-1])
        refused("slot_mapping length", sm=sm[:M * world - 1])
        refused("indexer_slot_mapping given", ism=sm.to(torch.int32))
        refused("topk_indices_buffer rows", topk=topk[:M - 1])
        w = x.w["q"].clone()
        call(q_w=w)
        w.data = w.view(torch.int16)  # the same address, another dtype, no version bump
        refused("weight dtype by .data", q_w=w)
        got[(transport, "good after refusals")] = torch.equal(call(), good)
        got[(transport, "indexer_slot_mapping accepted")] = torch.equal(call(ism=sm.clone()), good)

        # new values are used: another tensor; the same tensor's storage swapped by .data (no version bump); a
        # freed tensor's memory reused by a new tensor (numpy memory: the same address and version 0)
        twice = (x.w["q"].float() * 2).to(torch.bfloat16)
        want = call(q_w=twice.clone())
        got[(transport, "weights matter")] = not torch.equal(want, good)
        got[(transport, "another tensor")] = torch.equal(call(q_w=twice), want)
        w = x.w["q"].clone()
        call(q_w=w)
        w.data = twice.clone()
        got[(transport, ".data swap")] = torch.equal(call(q_w=w), want)
        mem = x.w["q"].view(torch.int16).numpy().copy()
        w = torch.from_numpy(mem).view(torch.bfloat16)
        got[(transport, "numpy first")] = torch.equal(call(q_w=w), good)
        ptr = w.data_ptr()
        del w
        mem[:] = twice.view(torch.int16).numpy()  # not a torch write: no version counter sees it
        w = torch.from_numpy(mem).view(torch.bfloat16)
        got[(transport, "address reused")] = (w.data_ptr() == ptr, w._version, torch.equal(call(q_w=w), want))
        pub.close()
    return got


@pytest.mark.parametrize("check", [False, True])
def test_a_changed_argument_is_checked_again_and_new_values_are_used(check):
    out = run_ranks(_memo_run, 1, check, timeout=300)
    kind, got = out[0]
    assert kind == "ok", got
    for transport in TRANSPORTS:
        for case, words in REFUSALS.items():
            msg = got[(transport, case)]
            assert all(w in msg for w in words) and "[WRITTEN]" not in msg, (transport, case, msg)
        for case in ("again", "good after refusals", "indexer_slot_mapping accepted", "weights matter",
                     "another tensor", ".data swap", "numpy first"):
            assert got[(transport, case)] is True, (transport, case)
        assert got[(transport, "address reused")] == (True, 0, True), (transport, got[(transport, "address reused")])
