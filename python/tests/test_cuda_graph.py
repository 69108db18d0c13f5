"""dispatch + fence + combine (staging) and dispatch + fence (direct) of W logical ranks on one GPU, captured
in one torch.cuda.CUDAGraph and replayed: on poisoned caches, with new inputs copied into the captured
tensors, several times (the device epoch counters advance across replays). Every replica must equal the CPU
reference's bytes (pcpkv's CPU kernels on the same inputs) after each replay, guard bytes included."""

import pytest

from helpers import World, assert_bytes_equal, llm_like, pk, requires_cuda, torch


def make_plan(world):
    reqs = [pk.Request(61, 0), pk.Request(33, 40), pk.Request(1, 100, decode=True), pk.Request(1, 7, decode=True),
            pk.Request(1, 0, decode=True)]
    return pk.make_plan(world, reqs, block_size=16, extra_blocks=3, seed=4)


def refresh_inputs(worlds, seed):
    """New activations, identical in both worlds, copied into the existing (captured) tensors."""
    gen = torch.Generator().manual_seed(seed)
    for r in range(worlds["cpu"].W):
        for k in ("q_c", "kv", "k_pe", "index_k"):
            new = llm_like(gen, *worlds["cpu"].local[r][k].shape)
            for w in worlds.values():
                w.local[r][k].copy_(new)


def check_against_cpu(worlds, what):
    torch.cuda.synchronize()
    worlds["cuda"].fence_state.check()
    for r in range(worlds["cpu"].W):
        for x, y, part in zip(worlds["cuda"].replica_bytes(r), worlds["cpu"].replica_bytes(r), ("mla", "index")):
            assert_bytes_equal(x, y, f"{what}: rank {r} {part} replica, graph replay vs CPU reference")
        assert torch.equal(worlds["cuda"].local[r]["q_c_out"].cpu(), worlds["cpu"].local[r]["q_c_out"])
        assert torch.equal(worlds["cuda"].local[r]["topk"].cpu(), worlds["cpu"].local[r]["topk"])


@requires_cuda
@pytest.mark.parametrize("transport", ["staging", "direct"])
@pytest.mark.parametrize("world", [2, 4])
def test_graph_replay_matches_cpu_reference(transport, world):
    plan = make_plan(world)
    fmt = pk.CacheFormat("fp8_ds_mla")
    worlds = {d: World(plan, fmt, d, seed=10, index_rope_interleaved=True) for d in ("cpu", "cuda")}
    g = worlds["cuda"]
    # Warm up on a side stream (as torch requires before capture), then capture one publication.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g.publish(transport, barrier_idx=1)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.publish(transport, barrier_idx=0)
    for replay in range(3):
        refresh_inputs(worlds, seed=100 + replay)
        for w in worlds.values():
            w.poison()
        worlds["cpu"].publish(transport)
        graph.replay()
        check_against_cpu(worlds, f"{transport} W={world} replay {replay}")
    # The fence ran once per replay on barrier 0: every hosted rank's epoch is 3 there.
    assert g.fence_state.epochs[:, 0].tolist() == [3] * world


@requires_cuda
def test_graph_staging_and_direct_in_one_graph_agree():
    """Both transports captured in one graph (two layers, two barrier indices) give identical replicas."""
    plan = make_plan(4)
    fmt = pk.CacheFormat("fp8_ds_mla")
    a = World(plan, fmt, "cuda", seed=3)
    b = World(plan, fmt, "cuda", seed=3)
    a.publish("staging", 0)
    b.publish("direct", 1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a.publish("staging", 0)
        b.publish("direct", 1)
    for w in (a, b):
        w.poison()
    graph.replay()
    torch.cuda.synchronize()
    for r in range(4):
        for x, y, part in zip(a.replica_bytes(r), b.replica_bytes(r), ("mla", "index")):
            assert_bytes_equal(x, y, f"rank {r} {part}: staging vs direct in one graph")
