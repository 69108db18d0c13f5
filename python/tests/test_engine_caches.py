"""pcpkv_torch.EngineCaches: peer tables over caches the engine allocated itself (one process per rank, gloo group).

A layer's direct and staging publication into engine-allocated caches of every rank, each replica byte-identical
(guard and padding bytes included) to the CPU oracle (the same step's direct publication of all W ranks into
one local replica); every refusal raised on every rank naming the rank, the tensor and why; close() releases
every peer mapping and refuses later use. GPU variants (N rank processes on one GPU through CUDA IPC, and a
CUDA-graph capture + replay) skip without a GPU:

    cd python && pytest tests/test_engine_caches.py -q
"""

import pytest

from helpers import GUARD, WHY_NO_CUDA, World, llm_like, pk, requires_cuda, torch  # noqa: F401
from dist_ranks import run_ranks

W = 2
REQS = [(37, 0, False), (20, 11, False), (1, 20, True), (1, 5, True)]
FMTS = [("fp8_ds_mla", True), ("fp8_ds_mla", False)]  # an indexer layer and a GLM-style shared layer


def _plan(world):
    return pk.make_plan(world, [pk.Request(n, c, decode=d) for n, c, d in REQS], block_size=16, extra_blocks=2,
                        seed=3)


def _flat(t):
    """A cache's whole extent (num_blocks block strides: padding and guard bytes included), as World.flat."""
    return torch.as_strided(t, (t.shape[0] * t.stride(0),), (1,), t.storage_offset())


def _carved(tensors, device):
    """The tensors as views of one allocation (vLLM carves its per-layer caches out of one buffer), 256-byte
    aligned, same geometry and contents."""
    sizes = [t.untyped_storage().nbytes() for t in tensors]
    offs = [sum((n + 255) // 256 * 256 for n in sizes[:i]) for i in range(len(sizes))]
    flat = torch.empty(offs[-1] + sizes[-1], dtype=torch.uint8, device=device)
    views = [flat.as_strided(t.shape, t.stride(), o) for t, o in zip(tensors, offs)]
    for v, t in zip(views, tensors):
        v.copy_(t)
    return views


def _engine_caches(plan, fmts, device, *, share=True, num_blocks=None, row_pad=16, one_allocation=False):
    """What an engine allocates for this rank: per layer an MLA cache (padded rows and blocks, vLLM-like) and an
    indexer cache where the layer has one, and one staging workspace per transport row size; guard-filled.
    one_allocation: all of them views of one buffer."""
    nb = num_blocks or plan.num_blocks
    mla = [pk.allocate_mla_cache(nb, plan.block_size, f.kv_format, device, row_pad=row_pad, block_pad=64,
                                 fill=GUARD) for f in fmts]
    idx = [pk.allocate_indexer_cache(nb, plan.block_size, device, block_pad=32, fill=GUARD) if f.has_indexer
           else None for f in fmts]
    rows = sorted({f.row_bytes for f in fmts})
    staging = [pk.allocate_staging(plan.pcp_world, plan.max_local_tokens,
                                   next(f for f in fmts if f.row_bytes == rb), device, fill=0) for rb in rows]
    if one_allocation:
        has = [i for i, t in enumerate(idx) if t is not None]
        views = _carved(mla + [idx[i] for i in has] + staging, device)
        mla, staging = views[:len(mla)], views[len(mla) + len(has):]
        for k, i in enumerate(has):
            idx[i] = views[len(mla) + k]
    if share and device == "cpu":
        for t in mla + [i for i in idx if i is not None] + staging:
            t.share_memory_()
    return mla, idx, staging


def _publish(rank, world, device, strategy, one_allocation=False):
    """Each rank publishes its tokens of both layers with direct, then with staging, into the engine's caches;
    returns, per transport and layer, whether its own replica equals the oracle's bytes."""
    import torch.multiprocessing as tmp
    from pcpkv_torch.distributed import resource_counts

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    tmp.set_sharing_strategy(strategy)
    plan = _plan(world)
    fmts = [pk.CacheFormat(k, has_indexer=i) for k, i in FMTS]
    inputs = [World(plan, f, device, seed=10 + l) for l, f in enumerate(fmts)]  # every rank's inputs, seeded
    oracle = []
    for l, f in enumerate(fmts):  # the CPU oracle: all W ranks' direct publication into local replicas
        o = World(plan, f, "cpu", seed=10 + l)
        o.publish("direct")
        oracle.append(o.replica_bytes(0))
    mla, idx, staging = _engine_caches(plan, fmts, device, one_allocation=one_allocation)
    before = resource_counts()
    ec = pk.EngineCaches(mla, idx, fmts, staging=staging, timeout_s=30.0)
    out = dict(kinds=sorted(set(ec.allocation_kinds.values())), during=resource_counts(),
               storages=len({t.untyped_storage().data_ptr() for v in ec.mla for t in v}))
    _both_transports(rank, ec, plan, fmts, inputs, oracle, mla, idx, device, out)
    ec.close()
    import gc
    gc.collect()
    out.update(before=before, after=resource_counts())
    return out


def _both_transports(rank, ec, plan, fmts, inputs, oracle, mla, idx, device, out):
    import torch.distributed as dist

    for transport in ("direct", "staging"):
        for t in mla + [i for i in idx if i is not None]:
            _flat(t).fill_(GUARD)
        if device != "cpu":
            torch.cuda.synchronize()
        dist.barrier()  # every replica is poisoned before any peer stores into it
        for l, f in enumerate(fmts):
            w = inputs[l]
            if transport == "direct":
                w.dispatch(rank, targets=ec.targets[l])
                pk.fence(ec.fence_state, 0, written=ec.mla[l] + (ec.index[l] or []))
            else:
                ws, dests = ec.staging_for(f, plan.max_local_tokens)
                w.dispatch(rank, row_dests=dests[l % 2])
                pk.fence(ec.fence_state, 0, written=ws)
                pk.combine(ws[rank][l % 2, 0], w.gathered, mla[l], idx[l], fmt=f)
        if device != "cpu":
            torch.cuda.synchronize()
            ec.fence_state.check()
        for l, f in enumerate(fmts):
            out[(transport, l, "mla")] = torch.equal(_flat(mla[l]).cpu(), oracle[l][0])
            if f.has_indexer:
                out[(transport, l, "index")] = torch.equal(_flat(idx[l]).cpu(), oracle[l][1])
        dist.barrier()  # every rank compared before anyone poisons again


def _check_published(out, device):
    for r in range(W):
        kind, val = out[r]
        assert kind == "ok", val
        bad = [k for k, v in val.items() if isinstance(k, tuple) and v is not True]
        assert not bad, f"rank {r}: replicas differ from the CPU oracle: {bad}"
        assert len([k for k in val if isinstance(k, tuple)]) == 2 * 3  # 2 transports x (mla, index, mla)
        if device == "cpu":
            # the peers' mappings existed during, and close() released every one of them
            assert val["during"]["shm_mappings"] > val["before"]["shm_mappings"], val
            assert val["after"]["shm_mappings"] == val["before"]["shm_mappings"], val
    return out[0][1]["kinds"]


@pytest.mark.parametrize("strategy,one_allocation", [("file_descriptor", False), ("file_system", False),
                                                     ("file_descriptor", True)])
def test_direct_and_staging_into_engine_allocated_cpu_caches(strategy, one_allocation):
    out = run_ranks(_publish, W, "cpu", strategy, one_allocation, timeout=120)
    kinds = _check_published(out, "cpu")
    want = "file descriptor" if strategy == "file_descriptor" else "file_system"
    assert all(want in k for k in kinds), kinds
    # views of one allocation: each rank's one storage is mapped once (W storages behind the MLA caches)
    assert out[0][1]["storages"] == (W if one_allocation else 2 * W), out[0][1]["storages"]


# ---- refusals: every rank raises, naming the rank, the tensor and why ----------------------------------------


def _refusals(rank, world):
    from pcpkv_torch import engine_caches

    plan = _plan(world)
    fmts = [pk.CacheFormat(k, has_indexer=i) for k, i in FMTS]
    got = {}

    def attempt(case, mla, idx, staging, formats=None, **kw):
        try:
            pk.EngineCaches(mla, idx, formats or fmts, staging=staging, timeout_s=30.0, **kw).close()
            got[case] = ("none", "")
        except (ValueError, RuntimeError) as e:
            got[case] = (type(e).__name__, str(e))

    # another shape on rank 1 (one block more)
    attempt("shape", *_engine_caches(plan, fmts, "cpu", num_blocks=plan.num_blocks + (rank == 1)))
    # other strides on rank 1 (rows padded differently)
    attempt("strides", *_engine_caches(plan, fmts, "cpu", row_pad=16 if rank == 0 else 32))
    # one fp8 k_scale written 2 on rank 0 and 2.0 on rank 1: one format (was refused as 'fmts differ')
    fp8 = [pk.CacheFormat("fp8", k_scale=2 if rank == 0 else 2.0, has_indexer=i) for _, i in FMTS]
    attempt("k_scale 2 and 2.0", *_engine_caches(plan, fp8, "cpu"), formats=fp8)
    # another num_barriers on rank 1: its fence pads differ
    attempt("num_barriers", *_engine_caches(plan, fmts, "cpu"), num_barriers=1 + rank)
    # rank 0 passes one MLA cache for both layers: they share memory
    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    attempt("overlap", [mla[0], mla[0]] if rank == 0 else mla, idx, staging)
    # rank 1's indexer cache is plain (unshared) CPU memory
    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    if rank == 1:
        idx[0] = pk.allocate_indexer_cache(plan.num_blocks, plan.block_size, "cpu", block_pad=32, fill=GUARD)
    attempt("unshared", mla, idx, staging)
    # rank 1 on another machine
    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    real = engine_caches._host_identity
    if rank == 1:
        engine_caches._host_identity = lambda: ("other-host", "0000")
    attempt("host", mla, idx, staging)
    engine_caches._host_identity = real
    # a staging workspace for another world size on rank 0 (a bad argument on one rank)
    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    if rank == 0:
        staging[0] = pk.allocate_staging(world + 1, plan.max_local_tokens, fmts[0]).share_memory_()
    attempt("staging", mla, idx, staging)
    # rank 1 cannot open rank 0's mapping: refused on both, and the mappings opened before are released
    import gc
    from pcpkv_torch.distributed import resource_counts

    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    real = engine_caches.EngineCaches._open_storage

    def failing(self, h):
        if self.rank == 1 and getattr(failing, "calls", 0) >= 2:
            raise OSError("injected: cannot open")
        failing.calls = getattr(failing, "calls", 0) + 1
        return real(self, h)

    engine_caches.EngineCaches._open_storage = failing
    before = resource_counts()["shm_mappings"]
    attempt("open", mla, idx, staging)
    gc.collect()
    got["open mappings left"] = resource_counts()["shm_mappings"] - before
    engine_caches.EngineCaches._open_storage = real
    # use after close
    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    ec = pk.EngineCaches(mla, idx, fmts, staging=staging, timeout_s=30.0)
    ec.close()
    for what, use in (("targets", lambda: ec.targets), ("fence_state", lambda: ec.fence_state),
                      ("row_dests", lambda: ec.row_dests(fmts[0])), ("mla", lambda: ec.mla),
                      ("staging_for", lambda: ec.staging_for(fmts[0], 1))):
        try:
            use()
            got[f"closed {what}"] = ("none", "")
        except RuntimeError as e:
            got[f"closed {what}"] = ("RuntimeError", str(e))
    return got


EXPECTED = {
    "shape": ("ValueError", ["rank 1: mla_caches[0] has shape", "rank 0's"]),
    "strides": ("ValueError", ["rank 1: mla_caches[0] has strides"]),
    "num_barriers": ("ValueError", ["rank 1: fence pads [num_barriers, 2, W]", "shape [2, 2, 2] but rank 0's has "
                                    "[1, 2, 2]"]),
    "overlap": ("ValueError", ["rank 0: mla_caches[0]", "shares memory with mla_caches[1]"]),
    "unshared": ("ValueError", ["rank 1: index_caches[0]", "not in shared memory", "share_memory_()"]),
    "host": ("RuntimeError", ["rank 1 is on host 'other-host'", "one host"]),
    "staging": ("ValueError", ["rank 0: staging[0]", "W=2"]),
    "open": ("RuntimeError", ["rank 1: cannot map rank 0's index_caches[0]: injected: cannot open"]),
}


def test_every_refusal_is_raised_on_every_rank_naming_rank_tensor_and_reason():
    out = run_ranks(_refusals, W, timeout=120)
    for r in range(W):
        kind, got = out[r]
        assert kind == "ok", got
        for case, (exc, parts) in EXPECTED.items():
            name, msg = got[case]
            assert name == exc, (r, case, got[case])
            for p in parts:
                assert p in msg, (r, case, p, msg)
        assert got["shape"][1] == out[0][1]["shape"][1]  # every rank says the same
        assert got["k_scale 2 and 2.0"] == ("none", ""), got["k_scale 2 and 2.0"]
        assert got["open mappings left"] == 0, got["open mappings left"]
        for what in ("targets", "fence_state", "row_dests", "mla", "staging_for"):
            name, msg = got[f"closed {what}"]
            assert name == "RuntimeError" and f"{what} used after close()" in msg, (r, what, got[f"closed {what}"])


def _timed_refusal(world, timeout_s, die=None):
    """(message, seconds) of this rank's EngineCaches RuntimeError, or None; die: exit (code 3) after the first
    exchange, "export": instead of exporting, "all-gather": inside the second all-gather, after arriving."""
    import os
    import time

    import torch.distributed as dist

    from pcpkv_torch import engine_caches

    plan = _plan(world)
    fmts = [pk.CacheFormat(k, has_indexer=i) for k, i in FMTS]
    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    if die == "export":
        engine_caches.EngineCaches._export = lambda self, fails: os._exit(3)
    elif die == "all-gather":
        calls, real = [], dist.all_gather  # an exchange is two all-gathers (lengths, bytes): rank_agreement

        def gather_then_die(*a, **kw):
            calls.append(1)
            if len(calls) == 3:  # the second exchange's first
                os._exit(3)
            return real(*a, **kw)

        dist.all_gather = gather_then_die
    t0 = time.monotonic()
    try:
        pk.EngineCaches(mla, idx, fmts, staging=staging, timeout_s=timeout_s)
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return None


def _one_rank_late(rank, world, late):
    """Rank `late` arrives 8 s after the others (timeout_s 3 s); they stay in the group until it has tried."""
    import time

    if rank == late:
        time.sleep(8)
        return _timed_refusal(world, 3.0)
    out = _timed_refusal(world, 3.0)
    time.sleep(12)
    return out


@pytest.mark.parametrize("late", [1, 0])
def test_a_rank_that_never_arrives_is_named_not_waited_for(late):
    # late = 0 was: gloo's monitored_barrier bounds only rank 0's wait; rank 1 waited for rank 0 the group's own
    # timeout (30 min by default; here until rank 0 arrived) and said "a rank did not arrive". The late rank
    # itself then passed the barrier on a stale message and waited in the all-gather until its peer exited.
    # Now the late rank finds the pair its peer timed out on closed.
    out = run_ranks(_one_rank_late, W, late, timeout=120)
    assert all(kind == "ok" and val is not None for kind, val in out.values()), out
    msg, seconds = out[1 - late][1]
    assert f"rank {late} did not arrive within timeout_s = 3.0 s" in msg, msg
    assert seconds < 6, (seconds, msg)
    msg, seconds = out[late][1]
    assert f"rank {1 - late} left the group (it exited, was killed, or gave up waiting" in msg, msg
    assert seconds < 3, (seconds, msg)


def _late_in_a_subgroup(rank, world):
    """Global ranks 1 and 2 form the group (ranks 0 and 1 in it); global rank 2 arrives 8 s late."""
    import time

    import torch.distributed as dist

    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    plan = _plan(2)
    fmts = [pk.CacheFormat(k, has_indexer=i) for k, i in FMTS]
    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    if rank == 2:
        time.sleep(8)
    try:
        pk.EngineCaches(mla, idx, fmts, staging=staging, group=group, timeout_s=3.0)
    except RuntimeError as e:
        out = str(e)
    if rank == 1:
        time.sleep(8)
    return out


def test_a_late_rank_of_a_subgroup_is_named_by_its_rank_in_the_group():
    out = run_ranks(_late_in_a_subgroup, 3, timeout=120)
    assert all(kind == "ok" for kind, _ in out.values()), out
    assert "rank 1 did not arrive within timeout_s = 3.0 s (seen from rank 0 of 2)" in out[1][1], out[1]
    assert "rank 0 left the group" in out[2][1] and "(seen from rank 1 of 2)" in out[2][1], out[2]


def _rank_1_killed_after_the_first_exchange(rank, world, where):
    return _timed_refusal(world, 20.0, die=where if rank == 1 else None)


@pytest.mark.parametrize("where, named", [
    ("export", "exporting the caches: rank 1 left the group (it exited, was killed"),
    # was: gloo's own error, raised as it came (no pcpkv_torch.EngineCaches, no step)
    ("all-gather", "exporting the caches: the torch.distributed group's all-gather failed on rank 0")])
def test_a_rank_killed_during_setup_is_named_promptly(where, named):
    out = run_ranks(_rank_1_killed_after_the_first_exchange, W, where, timeout=120)
    assert out[1] == ("exit", 3), out[1]
    kind, val = out[0]
    assert kind == "ok" and val is not None, out
    msg, seconds = val
    assert msg.startswith("pcpkv_torch.EngineCaches: ") and named in msg, msg
    assert seconds < 10, (seconds, msg)


def _outside_the_group(rank, world):
    import torch.distributed as dist

    plan = _plan(1)
    fmts = [pk.CacheFormat(k, has_indexer=i) for k, i in FMTS]
    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    group = dist.new_group([0])  # collective: every rank creates it, rank 1 is left out
    got = {}
    for case, g in (("member", group), ("not a group", 42)):
        if case == "member" and rank == 0:
            pk.EngineCaches(mla, idx, fmts, staging=staging, group=g, timeout_s=10.0).close()
            got[case] = ("ok", "")
            continue
        try:
            pk.EngineCaches(mla, idx, fmts, staging=staging, group=g, timeout_s=10.0)
            got[case] = ("ok", "")
        except (ValueError, RuntimeError) as e:
            got[case] = (type(e).__name__, str(e))
    return got


def test_a_process_outside_the_group_or_a_bad_group_is_a_value_error_naming_group():
    # Was: torch's own "Invalid process group specified" / "Process group 42 is not initialized ..." (no
    # 'group', no pcpkv_torch.EngineCaches), as SymmetricCaches already names it.
    out = run_ranks(_outside_the_group, W, timeout=120)
    assert all(kind == "ok" for kind, _ in out.values()), out
    assert out[0][1]["member"] == ("ok", ""), out[0]
    name, msg = out[1][1]["member"]
    assert name == "ValueError" and "EngineCaches: group: this process" in msg and "not a member" in msg, msg
    for r in range(W):
        name, msg = out[r][1]["not a group"]
        assert name == "ValueError" and "group = 42 is not a torch.distributed process group" in msg, msg


def test_peer_access_between_distinct_gpus_is_checked_per_peer(monkeypatch):
    # The topology check alone (one GPU here): rank 0 on GPU-0 with peers on its own GPU (fine), on a visible GPU
    # without peer access, and on a GPU this process cannot see.
    from pcpkv_torch import engine_caches

    monkeypatch.setattr(engine_caches, "_cuda_uuid", lambda i: f"GPU-{i}")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    ec = engine_caches.EngineCaches.__new__(engine_caches.EngineCaches)
    ec.rank, ec.device = 0, torch.device("cuda", 0)
    fails = ec._check_peer_access([{"uuid": u} for u in ("GPU-0", "GPU-0", "GPU-1", "GPU-7")])
    msgs = [m for _, m in fails]
    assert len(msgs) == 2, msgs
    assert "cuda:0 cannot access rank 2's GPU cuda:1 by peer access" in msgs[0], msgs
    assert "rank 3's GPU GPU-7 is not visible to this process" in msgs[1], msgs
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) == (0, 1))
    assert [m for _, m in ec._check_peer_access([{"uuid": u} for u in ("GPU-0", "GPU-1")])] == []


def test_arguments_are_checked_before_any_collective():
    # not initialized: refused at once, no rank waits
    plan = _plan(1)
    fmts = [pk.CacheFormat(k, has_indexer=i) for k, i in FMTS]
    mla, idx, staging = _engine_caches(plan, fmts, "cpu")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        pk.EngineCaches(mla, idx, fmts, staging=staging)


# ---- GPU: N rank processes on one GPU (CUDA IPC), and CUDA-graph capture + replay -------------------------------


@requires_cuda
def test_direct_and_staging_into_engine_allocated_cuda_caches_across_processes():
    kinds = _check_published(run_ranks(_publish, W, "cuda", "file_descriptor", timeout=300), "cuda")
    assert kinds and all("cudaMalloc" in k or "expandable" in k for k in kinds), kinds


def _graph(rank, world):
    """Each rank captures its layer-0 direct publication (dispatch into every rank's engine-allocated replica +
    fence) in a CUDA graph and replays it on poisoned caches with new inputs, three times."""
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    plan = _plan(world)
    fmt = pk.CacheFormat("fp8_ds_mla")
    cpu, gpu = World(plan, fmt, "cpu", seed=10), World(plan, fmt, "cuda", seed=10)
    mla, idx, _ = _engine_caches(plan, [fmt], "cuda")
    ec = pk.EngineCaches(mla, idx, [fmt], timeout_s=60.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch requires
        gpu.dispatch(rank, targets=ec.targets[0])
        pk.fence(ec.fence_state, 0, written=ec.mla[0] + ec.index[0])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.dispatch(rank, targets=ec.targets[0])
        pk.fence(ec.fence_state, 0, written=ec.mla[0] + ec.index[0])
    ok = []
    for replay in range(3):
        gen = torch.Generator().manual_seed(100 + replay)
        for r in range(world):  # new activations, the same in both worlds, into the captured tensors
            for k in ("q_c", "kv", "k_pe", "index_k"):
                new = llm_like(gen, *cpu.local[r][k].shape)
                cpu.local[r][k].copy_(new)
                gpu.local[r][k].copy_(new)
        cpu.poison()
        cpu.publish("direct")
        for t in mla + idx:
            _flat(t).fill_(GUARD)
        torch.cuda.synchronize()
        dist.barrier()  # every replica poisoned before any peer's replay stores into it
        graph.replay()
        torch.cuda.synchronize()
        ec.fence_state.check()
        want = cpu.replica_bytes(0)
        ok.append(torch.equal(_flat(mla[0]).cpu(), want[0]) and torch.equal(_flat(idx[0]).cpu(), want[1]))
        dist.barrier()
    del graph
    ec.close()
    return ok


@requires_cuda
def test_cuda_graph_replay_publishes_into_engine_allocated_caches():
    out = run_ranks(_graph, W, timeout=300)
    for r in range(W):
        assert out[r] == ("ok", [True, True, True]), out[r]


def _async_backend(rank, world):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    plan = _plan(world)
    fmts = [pk.CacheFormat(k, has_indexer=i) for k, i in FMTS]
    mla, idx, staging = _engine_caches(plan, fmts, "cuda")
    try:
        pk.EngineCaches(mla, idx, fmts, staging=staging, timeout_s=60.0)
    except RuntimeError as e:
        return str(e)
    return None


@requires_cuda
def test_cuda_malloc_async_backend_is_refused_naming_the_setting(monkeypatch):
    # torch picks the allocator backend when it loads: the rank processes inherit the setting from here
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    out = run_ranks(_async_backend, W, timeout=300)
    for r in range(W):
        kind, msg = out[r]
        assert kind == "ok" and msg is not None, out[r]
        assert "cudaMallocAsync" in msg and "PYTORCH_CUDA_ALLOC_CONF" in msg, msg


@requires_cuda
def test_expandable_segments_are_exported_or_refused_with_what_to_do(monkeypatch):
    # torch 2.11 exports an expandable segment's VMM handles (POSIX descriptors, imported with pidfd_getfd); where
    # the import is not permitted (ptrace_scope) or the segments were made without handles
    # (TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0), every rank must say so and what to do instead.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    out = run_ranks(_publish, W, "cuda", "file_descriptor", timeout=300)
    if all(kind == "ok" for kind, _ in out.values()):
        kinds = _check_published(out, "cuda")
        assert any("expandable segment" in k for k in kinds), kinds
    else:
        for r in range(W):
            kind, msg = out[r]
            assert kind == "err" and "expandable_segments" in msg, out[r]


# ---- the overlap check of a rank's own tensors: exact for interleaved layers ----------------------------------


def test_interleaved_layer_views_are_not_taken_for_shared_memory():
    # vLLM's cross-layer layout: one [num_blocks, L, block_size, row] buffer, layer l = buf[:, l]; the views'
    # extents overlap but no byte is shared (the break test saw "mla_caches[0] ... shares memory with
    # mla_caches[1]"); a view that does share bytes is still found
    from pcpkv_torch.engine_caches import _first_interleaved_overlap

    buf = torch.empty((5, 3, 4, 656), dtype=torch.uint8)
    layers = [(f"mla_caches[{l}]", buf[:, l]) for l in range(3)]
    assert _first_interleaved_overlap(layers) is None
    shifted = buf.view(-1)[656:].as_strided((5, 4, 656), (3 * 4 * 656, 656, 1))  # layer 0 one row later
    hit = _first_interleaved_overlap(layers + [("index_caches[0]", shifted)])
    assert hit is not None and {hit[0][0], hit[1][0]} == {"mla_caches[0]", "index_caches[0]"}, hit


def test_the_run_overlap_rule_matches_every_byte():
    # _runs_overlap against the byte sets themselves, on seeded random run sets (same and different steps)
    from pcpkv_torch.engine_caches import _runs_overlap

    gen = torch.Generator().manual_seed(31)
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    for _ in range(3000):
        runs = []
        for _ in range(2):
            count = rnd(1, 5)
            length = rnd(1, 12)
            step = rnd(length, 3 * length + 1) if count > 1 else 0
            if runs and runs[0][1] and count > 1 and rnd(0, 4):  # mostly the first set's step
                step = runs[0][1]
            runs.append((rnd(0, 60), step, count, length))
        sets = [{s + i * p + k for i in range(n) for k in range(ln)} for s, p, n, ln in runs]
        exact = bool(sets[0] & sets[1])
        got = _runs_overlap(*runs)
        same_step = runs[0][2] == 1 or runs[1][2] == 1 or runs[0][1] == runs[1][1]
        assert got == exact if same_step else got >= exact, (runs, got, exact)
