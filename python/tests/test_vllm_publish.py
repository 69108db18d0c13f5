"""pcpkv_torch.vllm.VllmPcpPublisher: vLLM's DeepSeek-V3.2 publication of a PCP step, through each transport, into
the caches the engine allocated (one process per rank, gloo group, CPU caches in shared memory).

The steps are built the way vLLM's PCPManager builds them (vllm/v1/worker/cp_utils.py at the commit named in
vllm_publish.py): each prefill's scheduled tokens padded to a multiple of 2W and split DualChunkSwap (rank r holds
chunks r and 2W-1-r), decodes first and replicated on every rank, the layer slot mapping gathered and rank-major
with -1 for padding and for the decode copies of ranks > 0. Three steps on the same caches: fresh prefills,
decodes + a chunked prefill whose context is cached + a fresh prefill, decodes only with CUDA-graph padding rows.

The reference is vLLM's collect path done literally with pcpkv's ops: every rank's bf16 rows materialized, the
cache inputs rank 0's decodes + every rank's prefill rows, the cache slot mapping the same cat
(_gather_prefill_cache_inputs), quantized and inserted. After every step every replica, whole allocation
(guard bytes included), is compared:
  * transport collect: byte-identical to that reference (every format);
  * direct / staging / auto: byte-identical to it where SPEC section 5 makes the bytes one function (bf16 "auto"
    MLA caches, every k_pe of fp8_ds_mla); byte-identical to the fused CPU oracle of the same cache inputs
    (the direct reference: the same rows, dispatched into one local replica) everywhere, and for the e4m3 rows
    (fp8 MLA rows, indexer K) within one e4m3 step of the collect reference's decoded values (collect quantizes
    from bf16-rounded values, so SPEC section 5 gives it its own bytes).
GPU variants (W processes on one GPU through CUDA IPC; a CUDA-graph capture + replay) skip here:

    cd python && pytest tests/test_vllm_publish.py -q
"""

import math

import pytest

from helpers import GUARD, POISON_BF16, POISON_I32, WHY_NO_CUDA, llm_like, norm_weight, pk, requires_cuda, torch  # noqa
from dist_ranks import run_ranks

W = 2
BS = 16
NUM_BLOCKS = 24
Q_LORA = 64
TOPK = 32
# (request id, num_computed_tokens, num_scheduled_tokens, decode), decodes first as vLLM reorders them
STEPS = [
    [(0, 0, 37, False), (1, 0, 13, False), (2, 0, 20, False)],                       # fresh prefills
    [(0, 37, 1, True), (1, 13, 1, True), (2, 20, 11, False), (3, 0, 5, False)],        # decodes, chunked prefill
    [(0, 38, 1, True), (1, 14, 1, True), (2, 31, 1, True), (3, 5, 1, True)],           # decodes only
]
GRAPH_PAD = [0, 0, 3]  # rows a CUDA-graph batch size adds after the real ones (slot -1)
LAYERS = [True, False]  # has an indexer cache (DeepSeek-V3.2's skip_topk layers have none)
MAX_POS = 64


def _blocks():
    """Each request's block table (distinct blocks, block 0 never used: vLLM's null block), seeded."""
    perm = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(5)) + 1
    return {rid: perm[4 * rid:4 * rid + 4].tolist() for rid in range(4)}


def _slot(blocks, rid, pos):
    return blocks[rid][pos // BS] * BS + pos % BS


def vllm_step(world, reqs, blocks, graph_pad=0, decode_copies=-1):
    """What vLLM's PCPManager gives every rank for one step: per rank the local rows [(rid, position, real)],
    the rank-major gathered slot mapping [W * M] and num_decode_tokens. decode_copies: what the decode copies of
    ranks > 0 hold, -1 (pad_slot_mapping) or "slot" (rank 0's slot: the publisher must still write each once)."""
    rows = []
    for r in range(world):
        mine = []
        for rid, ctx, n, decode in reqs:
            if decode:
                mine += [(rid, ctx + i, True) for i in range(n)]
                continue
            chunk = math.ceil(n / (2 * world))  # padded = chunk * 2W
            for rel in list(range(r * chunk, (r + 1) * chunk)) + \
                    list(range((2 * world - 1 - r) * chunk, (2 * world - r) * chunk)):
                mine.append((rid, ctx + rel, True) if rel < n else (rid, ctx, False))  # padding: the request's start
        mine += [(0, 0, False)] * graph_pad
        rows.append(mine)
    M = len(rows[0])
    assert all(len(x) == M for x in rows)
    nd = sum(n for _, _, n, d in reqs if d)
    sm = torch.full((world, M), -1, dtype=torch.int64)
    for r in range(world):
        for i, (rid, pos, real) in enumerate(rows[r]):
            if real and (i >= nd or r == 0 or decode_copies == "slot"):  # pad_slot_mapping: a decode's copies
                sm[r, i] = _slot(blocks, rid, pos)                             # past the first hold -1
    return rows, sm.view(-1), nd


class Inputs:
    """One layer's activations as the attention has them: a row per (request, position), the same on every rank
    (a replicated decode computes the same row everywhere); padding rows get junk."""

    def __init__(self, layer, has_indexer):
        gen = torch.Generator().manual_seed(100 + layer)
        self.per_req = {rid: dict(q_c=llm_like(gen, MAX_POS, Q_LORA), kv=llm_like(gen, MAX_POS, 512),
                                  k_pe=llm_like(gen, MAX_POS, 64, scale=2.0), index_k=llm_like(gen, MAX_POS, 128))
                        for rid in range(4)}
        self.w = dict(q=norm_weight(gen, Q_LORA).to(torch.bfloat16), kv=norm_weight(gen, 512).to(torch.bfloat16),
                      ln_w=norm_weight(gen, 128).to(torch.bfloat16),
                      ln_b=(0.1 * norm_weight(gen, 128)).to(torch.bfloat16))
        self.has_indexer = has_indexer
        rope = pk.RopeSpec("deepseek_yarn", 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
        self.cos_sin = pk.rope_table(rope, MAX_POS, "cpu")  # vLLM's [max_position, 64] = [cos 32 | sin 32]

    def rows(self, local, junk_seed):
        """(positions [M], fused_qkv_a_proj-like [M, Q_LORA + 576] whose splits are q_c, kv_c, k_pe; index_k)."""
        gen = torch.Generator().manual_seed(junk_seed)
        M = len(local)
        qkv = llm_like(gen, M, Q_LORA + 576)
        ik = llm_like(gen, M, 128)
        pos = torch.tensor([p for _, p, _ in local], dtype=torch.int64)
        for i, (rid, p, real) in enumerate(local):
            if real:
                d = self.per_req[rid]
                qkv[i] = torch.cat([d["q_c"][p], d["kv"][p], d["k_pe"][p]])
                ik[i] = d["index_k"][p]
        return pos, qkv, ik


def _splits(qkv):
    return qkv[:, :Q_LORA], qkv[:, Q_LORA:Q_LORA + 512], qkv[:, Q_LORA + 512:]


def _fmt(kv_cache_dtype, has_indexer):
    kf = {"auto": "bf16", "fp8_ds_mla": "fp8_ds_mla", "fp8": "fp8"}[kv_cache_dtype]
    return pk.CacheFormat(kf, "raw", 0.5 if kf == "fp8" else 1.0, has_indexer=has_indexer)


def _engine_caches(kv_cache_dtype, device, share):
    """What vLLM allocates per layer: the MLA cache in its dtype, the indexer cache where the layer has one."""
    last = 656 if kv_cache_dtype == "fp8_ds_mla" else 576
    dt = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8
    mla, idx = [], []
    for has in LAYERS:
        c = torch.empty((NUM_BLOCKS, BS, last), dtype=dt, device=device)
        c.view(torch.uint8).fill_(GUARD)
        x = torch.full((NUM_BLOCKS, BS, 132), GUARD, dtype=torch.uint8, device=device) if has else None
        if share:
            c.share_memory_()
            x = x.share_memory_() if x is not None else None
        mla.append(c)
        idx.append(x)
    return mla, idx


def _flat(t):
    t = t.view(torch.uint8)
    return torch.as_strided(t, (t.untyped_storage().nbytes(),), (1,), 0)


def _references(world, kv_cache_dtype):
    """Per step and layer, the replicas after it: vLLM's collect path (literal) and the fused CPU oracle; and
    per step, layer and rank the q_c_out rows."""
    blocks = _blocks()
    coll, fused = _engine_caches(kv_cache_dtype, "cpu", False), _engine_caches(kv_cache_dtype, "cpu", False)
    out = []
    for s, reqs in enumerate(STEPS):
        rows, sm, nd = vllm_step(world, reqs, blocks, GRAPH_PAD[s])
        M = len(rows[0])
        g = sm.view(world, M)
        step = dict(coll=[], fused=[], q_c=[])
        for layer, has in enumerate(LAYERS):
            x, fmt = Inputs(layer, has), _fmt(kv_cache_dtype, has)
            mats, raws, qs = [], [], []
            for r in range(world):
                pos, qkv, ik = x.rows(rows[r], 1000 * s + 10 * layer + r)
                q_c, kv, pe = _splits(qkv)
                kv_o, pe_o = torch.empty(M, 512, dtype=torch.bfloat16), torch.empty(M, 64, dtype=torch.bfloat16)
                ik_o = torch.empty(M, 128, dtype=torch.bfloat16) if has else None
                q_o = torch.empty(M, Q_LORA, dtype=torch.bfloat16)
                pk.dispatch(kv, pe, pos, x.w["kv"], x.cos_sin, fmt=fmt, q_c=q_c, q_norm_w=x.w["q"], q_c_out=q_o,
                            index_k=ik if has else None, index_ln_w=x.w["ln_w"] if has else None,
                            index_ln_b=x.w["ln_b"] if has else None, kv_c_out=kv_o, k_pe_out=pe_o,
                            index_k_out=ik_o)
                mats.append((kv_o, pe_o, ik_o))
                raws.append((pos, kv, pe, ik))
                qs.append(q_o)
            # vLLM's _gather_prefill_cache_inputs: rank 0's decodes, then every rank's prefill rows
            def cat(parts, k):
                return torch.cat([parts[0][k][:nd]] + [p[k][nd:] for p in parts]).contiguous()
            cache_slots = torch.cat([g[0, :nd], g[:, nd:].reshape(-1)]).contiguous()
            pk.insert(cat(mats, 0), cat(mats, 1), cat(mats, 2) if has else None, cache_slots,
                      coll[0][layer].view(torch.uint8), coll[1][layer], fmt=fmt)
            tgt = pk.CacheTargets.from_caches([fused[0][layer].view(torch.uint8)],
                                              [fused[1][layer]] if has else None, fmt)
            pk.dispatch(cat(raws, 1), cat(raws, 2), cat(raws, 0), x.w["kv"], x.cos_sin, fmt=fmt,
                        index_k=cat(raws, 3) if has else None, index_ln_w=x.w["ln_w"] if has else None,
                        index_ln_b=x.w["ln_b"] if has else None, slot_mapping=cache_slots, targets=tgt)
            step["coll"].append((_flat(coll[0][layer]).clone(), None if not has else _flat(coll[1][layer]).clone()))
            step["fused"].append((_flat(fused[0][layer]).clone(),
                                  None if not has else _flat(fused[1][layer]).clone()))
            step["q_c"].append(qs)
        out.append(step)
    return out


def _run(rank, world, kv_cache_dtype, device, transports, decode_copies=-1, check=True):
    """Every transport through the publisher over this rank's engine caches, three steps each; returns per
    (transport, step, layer) what matched. check=False: the per-call exchange off, and each layer's weights, tables
    and top-k buffer the same tensors in every step (as vLLM's parameters and persistent buffers), so publish()
    checks and converts them once per layer; ("conversions", transport) counts those."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    refs = _references(world, kv_cache_dtype)
    mla, idx = _engine_caches(kv_cache_dtype, device, device == "cpu")
    blocks = _blocks()
    res = {}
    import torch.distributed as dist
    from pcpkv_torch.vllm import VllmPcpPublisher

    converted = [0]
    real_convert = VllmPcpPublisher._convert

    def counted(self, *a):
        converted[0] += 1
        return real_convert(self, *a)

    VllmPcpPublisher._convert = counted
    held = {}  # check=False: layer -> (Inputs, its tables and top-k buffer on the device), kept across steps
    for transport in transports:
        converted[0] = 0
        pub = VllmPcpPublisher(mla, idx, kv_cache_dtype=kv_cache_dtype, max_num_tokens=48, transport=transport,
                               mla_k_scale=0.5, check=check, timeout_s=60.0)
        res[(transport, "chosen")] = pub.transport
        for t in mla + [x for x in idx if x is not None]:
            _flat(t).fill_(GUARD)
        dist.barrier()  # every replica poisoned before any peer stores into it
        for s, reqs in enumerate(STEPS):
            rows, sm, nd = vllm_step(world, reqs, blocks, GRAPH_PAD[s], decode_copies)
            M = len(rows[0])
            for layer, has in enumerate(LAYERS):
                if check or layer not in held:
                    x = Inputs(layer, has)
                    cs = x.cos_sin.to(device)
                    held[layer] = (x, {k: v.to(device) for k, v in x.w.items()}, cs, cs.clone() if has else None,
                                   torch.empty((52, TOPK), dtype=torch.int32, device=device))
                x, w, cs, cs_index, topk_buffer = held[layer]
                pos, qkv, ik = (t.to(device) for t in x.rows(rows[rank], 1000 * s + 10 * layer + rank))
                q_c, kv, pe = _splits(qkv)
                topk = topk_buffer[:M + 4].fill_(POISON_I32)
                q_out = torch.full((M, Q_LORA), POISON_BF16, dtype=torch.bfloat16, device=device)
                got = pub.publish(layer, pos, q_c, w["q"], 1e-6, kv, w["kv"], 1e-6, pe, cs,
                                  ik if has else None, w["ln_w"] if has else None, w["ln_b"] if has else None, 1e-6,
                                  cs_index, topk if check else topk_buffer, sm.to(device), nd, q_c_out=q_out)
                res[(transport, s, layer, "q_c_out")] = got is q_out and torch.equal(
                    q_out.cpu(), refs[s]["q_c"][layer][rank])
                res[(transport, s, layer, "topk")] = (not has and bool((topk == POISON_I32).all())) or (
                    has and bool((topk[:M] == -1).all()) and bool((topk[M:] == POISON_I32).all()))
            if device != "cpu":
                torch.cuda.synchronize()
            dist.barrier()  # every rank's step is in every replica
            for layer, has in enumerate(LAYERS):
                mine = (_flat(mla[layer]).cpu(), _flat(idx[layer]).cpu() if has else None)
                c, f = refs[s]["coll"][layer], refs[s]["fused"][layer]
                res[(transport, s, layer)] = _compare(mine, c, f, pub.transport, kv_cache_dtype, has)
            dist.barrier()
        pub.close()
        if not check:
            res[("conversions", transport)] = converted[0]
    return res


def _compare(mine, coll, fused, transport, kv_cache_dtype, has):
    """'ok' or what differs (see the module docstring for which reference each transport must equal)."""
    want = coll if transport == "collect" else fused
    for k, name in ((0, "MLA cache"), (1, "indexer cache")):
        if k == 1 and not has:
            continue
        if not torch.equal(mine[k], want[k]):
            n = int((mine[k] != want[k]).sum())
            return f"{name}: {n} bytes differ from the {'collect' if transport == 'collect' else 'fused'} reference"
    if transport != "collect" and kv_cache_dtype == "auto" and not torch.equal(mine[0], coll[0]):
        return "bf16 MLA cache differs from vLLM's collect path"
    if transport != "collect" and kv_cache_dtype != "auto":
        # fp8 rows: the collect path quantized bf16-rounded values; decoded values within one e4m3 step
        kf = "fp8_ds_mla" if kv_cache_dtype == "fp8_ds_mla" else "fp8"
        shape = (NUM_BLOCKS, BS, 656 if kf == "fp8_ds_mla" else 576)
        a = pk.dequantize_mla(mine[0].view(shape), kf, 0.5)
        b = pk.dequantize_mla(coll[0].view(shape), kf, 0.5)
        if kf == "fp8_ds_mla" and not torch.equal(a[1], b[1]):
            return "fp8_ds_mla k_pe (bf16) differs from vLLM's collect path"
        if not torch.allclose(a[0], b[0], rtol=0.13, atol=1e-3 * float(b[0].abs().max())):
            return "fp8 kv_c decodes farther than one e4m3 step from vLLM's collect path"
    if transport != "collect" and has:  # the indexer's e4m3 rows, likewise
        a = pk.dequantize_indexer(mine[1].view(NUM_BLOCKS, BS, 132))
        b = pk.dequantize_indexer(coll[1].view(NUM_BLOCKS, BS, 132))
        if not torch.allclose(a, b, rtol=0.13, atol=1e-3 * float(b.abs().max())):
            return "indexer K decodes farther than one e4m3 step from vLLM's collect path"
    return "ok"


def _check(out, transports, world=W):
    for r in range(world):
        kind, val = out[r]
        assert kind == "ok", val
        bad = {k: v for k, v in val.items() if "chosen" not in k and v not in (True, "ok")}
        assert not bad, f"rank {r}: {bad}"
        n = sum(1 for k in val if "chosen" not in k)
        assert n == len(transports) * len(STEPS) * len(LAYERS) * 3, n


@pytest.mark.parametrize("kv_cache_dtype,decode_copies,world", [("fp8_ds_mla", -1, W), ("auto", -1, W), ("fp8", -1, W),
                                                                ("fp8_ds_mla", "slot", W), ("fp8_ds_mla", -1, 3)])
def test_every_transport_matches_vllms_collect_path_cpu(kv_cache_dtype, decode_copies, world):
    transports = ("collect", "direct", "staging", "auto")
    out = run_ranks(_run, world, kv_cache_dtype, "cpu", transports, decode_copies, timeout=300)
    _check(out, transports, world)
    for r in range(world):
        assert out[r][1][("auto", "chosen")] == "direct"  # one host, shared memory between every pair


@pytest.mark.parametrize("kv_cache_dtype,decode_copies", [("fp8_ds_mla", -1), ("auto", "slot")])
def test_without_per_call_checks_every_transport_matches_vllms_collect_path_cpu(kv_cache_dtype, decode_copies):
    # check=False with the same weights, tables and top-k buffer every step: publish() checks and converts them
    # once per layer (its memo; issue 35 item 4) and writes the same bytes, q_c_out and top-k fill as the checked
    # path, whose tensors are new every step
    transports = ("direct", "staging", "collect")
    out = run_ranks(_run, W, kv_cache_dtype, "cpu", transports, decode_copies, False, timeout=300)
    for r in range(W):
        assert out[r][0] == "ok", out[r][1]
        for transport in transports:
            assert out[r][1].pop(("conversions", transport)) == len(LAYERS), out[r][1]
    _check(out, transports)


def test_the_step_builder_follows_vllms_pcp_manager():
    # vLLM's documented example (cp_utils.py compute_rank_indices): tokens [1, 5, 8] at pcp 2, the first a decode:
    # rank 0 holds [decode, 0, 1, 6(pad), 7(pad), 0, 1, 6, 7], rank 1 [decode, 2, 3, 4, 5(pad), 2, 3, 4, 5]
    blocks = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8], 2: [9, 10, 11, 12]}
    rows, sm, nd = vllm_step(2, [(0, 3, 1, True), (1, 0, 5, False), (2, 0, 8, False)], blocks)
    assert nd == 1
    assert [p - 0 for _, p, real in rows[0]][1:] == [0, 1, 0, 0, 0, 1, 6, 7]  # padding rows at the request's start
    assert [real for _, _, real in rows[0]] == [True, True, True, False, False, True, True, True, True]
    assert [p for _, p, _ in rows[1]] == [3, 2, 3, 4, 0, 2, 3, 4, 5]
    g = sm.view(2, -1)
    assert g[1, 0] == -1 and g[0, 0] == _slot(blocks, 0, 3)  # only rank 0's decode copy writes
    assert g[0, 3] == -1 and g[0, 4] == -1 and g[1, 4] == -1
    assert g[1, 1] == _slot(blocks, 1, 2)


def _staging_one_layer(rank, world):
    """One indexer layer (an odd layer count), two steps with staging; rank 1 combines slowly, so rank 0 reaches
    the next step's dispatch while rank 1 still reads the previous rows out of its workspace."""
    import time

    import torch.distributed as dist
    from pcpkv_torch import vllm_publish
    from pcpkv_torch.vllm import VllmPcpPublisher

    if rank == 1:  # the combine op, as publish() calls it (vllm_publish._OPS: dispatch, fence, combine, insert)
        real = vllm_publish._OPS

        def slow(*a):
            time.sleep(0.5)
            return real[2](*a)
        vllm_publish._OPS = real[:2] + (slow,) + real[3:]
    refs = _references(world, "fp8_ds_mla")
    mla, idx = _engine_caches("fp8_ds_mla", "cpu", True)
    pub = VllmPcpPublisher(mla[:1], idx[:1], kv_cache_dtype="fp8_ds_mla", max_num_tokens=48, transport="staging",
                           check=False)
    blocks, x = _blocks(), Inputs(0, True)
    for s in range(2):
        rows, sm, nd = vllm_step(world, STEPS[s], blocks, GRAPH_PAD[s])
        pos, qkv, ik = x.rows(rows[rank], 1000 * s + rank)
        q_c, kv, pe = _splits(qkv)
        pub.publish(0, pos, q_c, x.w["q"], 1e-6, kv, x.w["kv"], 1e-6, pe, x.cos_sin, ik, x.w["ln_w"], x.w["ln_b"],
                    1e-6, x.cos_sin, torch.empty((len(rows[0]), TOPK), dtype=torch.int32), sm, nd)
    dist.barrier()
    ok = torch.equal(_flat(mla[0]), refs[1]["fused"][0][0]) and torch.equal(_flat(idx[0]), refs[1]["fused"][0][1])
    pub.close()
    return ok


def test_staging_alternates_its_buffers_per_call_across_steps():
    # by layer parity a one-layer model reused buffer 0 from one step to the next: rank 0's rows of step 1 landed
    # in rank 1's workspace while rank 1 still combined step 0's rows from it
    out = run_ranks(_staging_one_layer, W, timeout=120)
    assert out[0] == ("ok", True) and out[1] == ("ok", True), out


# ---- every rank agrees or every rank refuses, before anything is written ---------------------------------------


def _refusals(rank, world):
    import torch.distributed as dist
    from pcpkv_torch.vllm import VllmPcpPublisher

    got = {}
    blocks = _blocks()
    rows, sm, nd = vllm_step(world, STEPS[1], blocks)
    x = Inputs(0, True)
    pos, qkv, ik = x.rows(rows[rank], 7 + rank)
    q_c, kv, pe = _splits(qkv)
    M = len(rows[0])

    def attempt(case, fn):
        try:
            fn()
            got[case] = ("none", "")
        except (ValueError, RuntimeError) as e:
            got[case] = (type(e).__name__, str(e))

    mla, idx = _engine_caches("fp8_ds_mla", "cpu", True)
    # setup: rank 1 asks for another transport; rank 0 passes an fp8_ds_mla cache as "fp8"
    attempt("transport", lambda: VllmPcpPublisher(mla, idx, max_num_tokens=M, kv_cache_dtype="fp8_ds_mla",
                                                  transport="direct" if rank == 0 else "staging").close())
    attempt("dtype", lambda: VllmPcpPublisher(mla, idx, max_num_tokens=M, transport="direct",
                                              kv_cache_dtype="fp8" if rank == 0 else "fp8_ds_mla").close())
    pub = VllmPcpPublisher(mla, idx, kv_cache_dtype="fp8_ds_mla", max_num_tokens=M, transport="direct")
    topk = torch.zeros((M, TOPK), dtype=torch.int32)

    def call(sm_=sm, nd_=nd, **kw):
        a = dict(index_k=ik, index_k_rope_cos_sin_cache=x.cos_sin, q_w=x.w["q"])
        a.update(kw)
        pub.publish(0, pos, q_c, a["q_w"], 1e-6, kv, x.w["kv"], 1e-6, pe, x.cos_sin, a["index_k"], x.w["ln_w"],
                    x.w["ln_b"], 1e-6, a["index_k_rope_cos_sin_cache"], topk, sm_, nd_)

    attempt("num_decode_tokens", lambda: call(nd_=nd + (rank == 1)))
    other = sm.clone()
    other[-1] = _slot(blocks, 3, 40) if rank == 0 else other[-1]
    attempt("slot_mapping contents", lambda: call(sm_=other))
    attempt("slot_mapping short", lambda: call(sm_=sm[:-1] if rank == 1 else sm))
    attempt("index_k missing", lambda: call(index_k=None if rank == 0 else ik))
    attempt("weight", lambda: call(q_w=x.w["q"].to(torch.int32) if rank == 1 else x.w["q"]))
    attempt("index table", lambda: call(index_k_rope_cos_sin_cache=x.cos_sin * 2 if rank == 0 else x.cos_sin))
    dist.barrier()
    got["untouched"] = all(bool((_flat(t) == GUARD).all()) for t in mla + [idx[0]])
    attempt("ok", call)  # the same call, good on both ranks: it publishes
    pub.close()
    attempt("after close", call)
    return got


def test_a_bad_or_disagreeing_call_is_refused_on_every_rank_before_any_write():
    out = run_ranks(_refusals, W, timeout=180)
    for r in range(W):
        kind, got = out[r]
        assert kind == "ok", got
        assert got["transport"][0] == "ValueError" and "transport" in got["transport"][1] and \
            "'direct'" in got["transport"][1] and "'staging'" in got["transport"][1], got["transport"]
        assert got["dtype"][0] == "ValueError" and "bad argument on rank 0" in got["dtype"][1] and \
            "kv_caches[0]" in got["dtype"][1], got["dtype"]
        for case, words in (("num_decode_tokens", ["num_decode_tokens"]),
                            ("slot_mapping contents", ["slot_mapping", "sha256"]),
                            ("slot_mapping short", ["bad argument on rank 1", "slot_mapping"]),
                            ("index_k missing", ["bad argument on rank 0", "index_k is None"]),
                            ("weight", ["bad argument on rank 1", "q_rms_norm_w", "floating-point"])):
            kind_, msg = got[case]
            assert kind_ == "ValueError" and all(w in msg for w in words), (case, got[case])
        kind_, msg = got["index table"]
        assert kind_ == "ValueError" and "bad argument on rank 0" in msg and "index_k_rope_cos_sin_cache" in msg, msg
        assert got["untouched"] is True
        assert got["ok"] == ("none", ""), got["ok"]
        assert got["after close"][0] == "RuntimeError" and "after close" in got["after close"][1]


# ---- GPU: W rank processes on one GPU (CUDA IPC), and CUDA-graph capture + replay -------------------------------


@requires_cuda
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "auto"])
def test_every_transport_matches_vllms_collect_path_cuda(kv_cache_dtype):
    transports = ("collect", "direct", "staging", "auto")
    out = run_ranks(_run, W, kv_cache_dtype, "cuda", transports, timeout=600)
    _check(out, transports)


def _graph(rank, world, transport):
    """Each rank captures step 0's publication of both layers (check=False: nothing but dispatch, fence, combine)
    in a CUDA graph and replays it on poisoned caches; every replica must equal the fused CPU oracle."""
    import torch.distributed as dist
    from pcpkv_torch.vllm import VllmPcpPublisher

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = f"cuda:{torch.cuda.current_device()}"
    refs = _references(world, "fp8_ds_mla")
    mla, idx = _engine_caches("fp8_ds_mla", dev, False)
    pub = VllmPcpPublisher(mla, idx, kv_cache_dtype="fp8_ds_mla", max_num_tokens=48, transport=transport,
                           check=False, timeout_s=60.0)
    rows, sm, nd = vllm_step(world, STEPS[0], _blocks(), GRAPH_PAD[0])
    M = len(rows[0])
    args = []
    for layer, has in enumerate(LAYERS):
        x = Inputs(layer, has)
        pos, qkv, ik = (t.to(dev) for t in x.rows(rows[rank], 10 * layer + rank))
        q_c, kv, pe = _splits(qkv)
        w = {k: v.to(dev) for k, v in x.w.items()}
        cs = x.cos_sin.to(dev)
        args.append((layer, pos, q_c, w["q"], 1e-6, kv, w["kv"], 1e-6, pe, cs, ik if has else None,
                     w["ln_w"] if has else None, w["ln_b"] if has else None, 1e-6, cs if has else None,
                     torch.empty((M, TOPK), dtype=torch.int32, device=dev), sm.to(dev), nd))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the table conversions and memos happen outside the capture
        for a in args:
            pub.publish(*a)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in args:
            pub.publish(*a)
    ok = []
    for _ in range(2):
        for t in mla + [x for x in idx if x is not None]:
            _flat(t).fill_(GUARD)
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        pub.caches.fence_state.check()
        dist.barrier()
        for layer, has in enumerate(LAYERS):
            f = refs[0]["fused"][layer]
            ok.append(torch.equal(_flat(mla[layer]).cpu(), f[0]) and (not has or torch.equal(_flat(idx[layer]).cpu(),
                                                                                              f[1])))
        dist.barrier()
    del graph
    pub.close()
    return ok


@requires_cuda
@pytest.mark.parametrize("transport", ["direct", "staging"])
def test_cuda_graph_replay_of_the_publication(transport):
    out = run_ranks(_graph, W, transport, timeout=600)
    for r in range(W):
        assert out[r] == ("ok", [True] * 4), out[r]
