"""The whole-model PCP prefill with one process per rank (DistPcpModel, pcpkv_torch.models.dist_world) on CPU:
spawned gloo ranks, caches in pcpkv symmetric memory. (a) logits of a schedule (uneven fresh prefills, a chunked
prefill over cached context next to a decode, decodes) equal the single-process PcpModel's byte for byte, for every
transport, P = 2 and 4, with the run-time replica check on (so it passes on healthy replicas), and every replica of
every layer byte-identical; (b) a rank killed mid-run (os._exit in its layer-1 publication) makes the others raise
naming it within the fence timeout; (c) one corrupted byte in one rank's replica makes the replica check raise on
every rank naming the layer, the rank and the slot."""

import atexit
import functools
import os
import shutil
import tempfile
import time

import pytest

from helpers import require_hf_models, torch
from dist_ranks import run_ranks

require_hf_models("glm_moe_dsa")
from pcpkv_torch.models import build_hf_model, small_config

LAYERS, TOPK, BLOCK, NUM_BLOCKS = 4, 32, 16, 24
FENCE_TIMEOUT_S = 3.0
TRANSPORTS = ("direct", "staging", "collect")


def _schedule():
    from pcpkv_torch.models import StepRequest

    a = torch.randint(0, 512, (102,), generator=torch.Generator().manual_seed(1))
    b = torch.randint(0, 512, (19,), generator=torch.Generator().manual_seed(2))
    return [
        [StepRequest("a", a[:80]), StepRequest("b", b[:17])],
        [StepRequest("a", a[80:100], context_len=80), StepRequest("b", b[17:18], context_len=17, decode=True)],
        [StepRequest("a", a[100:101], context_len=100, decode=True),
         StepRequest("b", b[18:19], context_len=18, decode=True)],
    ]


@functools.lru_cache(maxsize=None)
def model_file():
    """The seeded model, built once and loaded by every rank process (building it takes seconds per process)."""
    cfg = small_config("glm-5", num_layers=LAYERS, index_topk=TOPK, first_dense=1, hidden_size=256)
    d = tempfile.mkdtemp(prefix="pcpkv-test-model-")
    atexit.register(shutil.rmtree, d, True)  # each run left its 15 MB model in /tmp (43 found)
    path = os.path.join(d, "model.pt")
    torch.save(build_hf_model(cfg, seed=7), path)
    return path


def _dist_model(model, transport, **kw):
    from pcpkv_torch.models import DistPcpModel

    return DistPcpModel(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, transport=transport, poison=True,
                        timeout_s=30.0, fence_timeout_s=FENCE_TIMEOUT_S, **kw)


def _prefill(rank, world, path, transports):
    from pcpkv_torch.models import PcpModel

    model = torch.load(path, weights_only=False)
    out = {}
    for tr in transports:
        pcp = _dist_model(model, tr, check_replicas=True)
        try:
            logits = [pcp.step(s)[0] for s in _schedule()]
            reps = [[pcp.world.replica_bytes(layer, r) for r in range(world)] for layer in range(LAYERS)]
        finally:
            pcp.restore()
            pcp.world.close()
        same = all(torch.equal(m, rs[0][0]) and (i is None or torch.equal(i, rs[0][1]))
                   for rs in reps for m, i in rs)
        res = dict(replicas_identical=same, untouched_guard=int(reps[0][rank][0][0].min()) == 0xA5)
        if rank == 0:  # the single-process runs, in this process (same threads, same kernels)
            for P in (world, 1):
                ref = PcpModel(model, P, num_blocks=NUM_BLOCKS, block_size=BLOCK, transport=tr, poison=True)
                try:
                    want = [ref.step(s)[0] for s in _schedule()]
                    ref_cache = ref.world.replica_bytes(0, 0)
                finally:
                    ref.restore()
                res[f"logits == single-process P {P}"] = all(torch.equal(a, b) for a, b in zip(logits, want))
                res[f"layer-0 cache == single-process P {P}"] = torch.equal(reps[0][0][0], ref_cache[0])
        out[tr] = res
    return out


def _prefill_then_corrupt(rank, world, path, transports):
    """Both P = 2 scenarios in one spawn (a spawn costs seconds): (a), then (c)."""
    return dict(prefill=_prefill(rank, world, path, transports), corrupt=_corrupted(rank, world, path, 1, 2))


@pytest.fixture(scope="module")
def p2_run():
    return run_ranks(_prefill_then_corrupt, 2, model_file(), TRANSPORTS, timeout=120)


@pytest.mark.parametrize("P", [2, 4])
def test_logits_equal_the_single_process_run(P, request):
    if P == 2:
        out = {r: (k, v["prefill"] if k == "ok" else v) for r, (k, v) in request.getfixturevalue("p2_run").items()}
    else:
        out = run_ranks(_prefill, P, model_file(), TRANSPORTS, timeout=120)
    for r in range(P):
        kind, val = out[r]
        assert kind == "ok", val
        for tr, res in val.items():
            assert all(res.values()), (r, tr, res)
    assert len(out[0][1]["direct"]) == 6  # rank 0 compared with both single-process runs


def _killed(rank, world, path, victim):
    from pcpkv_torch.models import dist_world

    model = torch.load(path, weights_only=False)
    publish = dist_world.DistPcpWorld.publish

    def dying_publish(self, layer_idx, *a, **k):
        if rank == victim and layer_idx == 1:
            os._exit(17)  # killed mid-run: after layer 0, before its layer-1 publication
        return publish(self, layer_idx, *a, **k)

    dist_world.DistPcpWorld.publish = dying_publish
    pcp = _dist_model(model, "direct")
    t0 = time.monotonic()
    try:
        pcp.step(_schedule()[0])
    except RuntimeError as e:
        return dict(error=str(e), seconds=time.monotonic() - t0)
    finally:
        pcp.restore()
        pcp.world.close()
    return dict(error=None)


def test_a_killed_rank_is_named_by_the_others():
    out = run_ranks(_killed, 2, model_file(), 1, timeout=60)
    assert out[1] == ("exit", 17), out[1]
    kind, val = out[0]
    assert kind == "ok" and val["error"] is not None, val
    assert "rank 1" in val["error"] and "exited or was killed" in val["error"], val
    assert val["seconds"] < FENCE_TIMEOUT_S + 10, val


def _corrupted(rank, world, path, victim, layer):
    from pcpkv_torch.models import dist_world

    model = torch.load(path, weights_only=False)
    publish = dist_world.DistPcpWorld.publish
    seen = {}

    def corrupting_publish(self, layer_idx, transport, local, step, *a, **k):
        publish(self, layer_idx, transport, local, step, *a, **k)
        if rank == victim and layer_idx == layer:
            s = step.gathered_slot_mapping
            slot = int(s[s >= 0][5])
            m = self.mla[layer_idx][rank]
            m.view(-1, m.shape[2])[slot, 100] ^= 0x01  # one bit of one byte of this rank's replica
            seen["slot"] = slot

    dist_world.DistPcpWorld.publish = corrupting_publish
    pcp = _dist_model(model, "staging", check_replicas=True)
    try:
        pcp.step(_schedule()[0])
    except RuntimeError as e:
        return dict(error=str(e), slot=seen.get("slot"))
    finally:
        pcp.restore()
        pcp.world.close()
    return dict(error=None)


def test_a_corrupted_replica_is_named_by_the_replica_check(p2_run):
    out = {r: (k, v["corrupt"] if k == "ok" else v) for r, (k, v) in p2_run.items()}
    slot = out[1][1].get("slot") if out[1][0] == "ok" else None
    assert slot is not None, out
    for r in range(2):
        kind, val = out[r]
        assert kind == "ok" and val["error"] is not None, val
        assert f"layer 2: rank 1 differs from rank 0 at slot {slot} " in val["error"], val
