"""The ops under torch.compile: torch.library.opcheck (schema mutation marks, fake kernels, AOT dispatch) and a
whole staging publication compiled with fullgraph=True giving the eager bytes."""

import pytest

from helpers import DEVICES, World, assert_bytes_equal, pk, poisoned_bf16, torch


BACKEND = "inductor"


def plan_of(world):
    return pk.make_plan(world, [pk.Request(29, 0), pk.Request(1, 9, decode=True)], block_size=16, seed=2)


def dispatch_args(w, r, **over):
    """Positional arguments of torch.ops.pcpkv.dispatch for rank r of world w (staging + direct + outputs)."""
    loc, wt, fmt = w.local[r], w.weights, w.fmt
    M = w.M
    kv_c_out = poisoned_bf16(M, 512, w.device)
    args = [loc["kv"], loc["k_pe"], loc["positions"], wt["kv_norm_w"], w.rope_cos_sin, loc["q_c"], wt["q_norm_w"],
            loc["index_k"], wt["index_ln_w"], wt["index_ln_b"], loc["slot_mapping"], w.targets.table, w.targets.host,
            w.dests[r].table, w.dests[r].host, loc["q_c_out"], kv_c_out, None, None, loc["topk"],
            w.targets.tensors + w.dests[r].tensors, fmt.kv_format, fmt.ds_mla_scale, fmt.k_scale, fmt.has_indexer,
            1e-6, 1e-6, 1e-6, True, False, False]
    return args


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    w = World(plan_of(2), pk.CacheFormat("fp8_ds_mla"), device, seed=1)
    torch.library.opcheck(torch.ops.pcpkv.dispatch.default, dispatch_args(w, 0))
    f = w.fmt
    torch.library.opcheck(torch.ops.pcpkv.combine.default,
                          (w.staging[0][0, 0], w.gathered, w.mla[0], w.idx[0], f.kv_format, f.ds_mla_scale, f.k_scale,
                           True))
    n = w.M
    kv_c = torch.zeros(n, 512, dtype=torch.bfloat16, device=w.device) + 1
    torch.library.opcheck(torch.ops.pcpkv.insert.default,
                          (kv_c, kv_c[:, :64].contiguous(), kv_c[:, :128].contiguous(), w.local[0]["slot_mapping"],
                           w.mla[1], w.idx[1], f.kv_format, f.ds_mla_scale, f.k_scale))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_publication_equals_eager(device):
    plan = plan_of(2)
    fmt = pk.CacheFormat("fp8_ds_mla")
    eager = World(plan, fmt, device, seed=4)
    comp = World(plan, fmt, device, seed=4)
    eager.publish("staging")

    @torch.compile(fullgraph=True, backend=BACKEND)
    def publish():
        comp.publish("staging")

    publish()
    if device == "cuda":
        torch.cuda.synchronize()
    for r in range(plan.pcp_world):
        for x, y, part in zip(comp.replica_bytes(r), eager.replica_bytes(r), ("mla", "index")):
            assert_bytes_equal(x, y, f"rank {r} {part}: compiled vs eager")
