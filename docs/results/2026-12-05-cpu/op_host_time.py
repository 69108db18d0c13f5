"""Host time of one pcpkv_torch.dispatch call (docs/perf.md section 37), CPU tensors, 2-core CI machine.

Usage: cd python && ../build/python-venv/bin/pcpkv-python ../docs/results/2026-12-05-cpu/op_host_time.py
A rank's direct dispatch into W = 8 replicas (fp8_ds_mla + indexer, Q norm, top-k fill), with T = 0 local tokens, so
that what is timed is the call's host path alone: the Python wrapper, the dispatcher, the C++ checks (the CPU kernel
has no token to process). Also timed: the C++ op called directly (no wrapper), and an aten op of 3 tensors for scale.
"""
import statistics
import sys
import time

sys.path.insert(0, "tests")
import torch  # noqa: E402
import pcpkv_torch as pk  # noqa: E402
from helpers import World  # noqa: E402


def per_call_us(fn, n=2000, rounds=5):
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out), min(out)


def main():
    torch.set_num_threads(1)
    reqs = [pk.Request(37, 0), pk.Request(50, 11), pk.Request(1, 20, decode=True), pk.Request(1, 5, decode=True)]
    plan = pk.make_plan(8, reqs, block_size=16, extra_blocks=2, seed=0)
    fmt = pk.CacheFormat("fp8_ds_mla", has_indexer=True)
    w = World(plan, fmt, "cpu", seed=1)
    loc = {k: (v[:0] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v) for k, v in w.local[0].items()}
    wt = w.weights
    kw = dict(fmt=fmt, q_c=loc["q_c"], q_norm_w=wt["q_norm_w"], q_c_out=loc["q_c_out"], index_k=loc["index_k"],
              index_ln_w=wt["index_ln_w"], index_ln_b=wt["index_ln_b"], slot_mapping=loc["slot_mapping"],
              targets=w.targets, topk_fill=loc["topk"])

    def wrapper():
        pk.dispatch(loc["kv"], loc["k_pe"], loc["positions"], wt["kv_norm_w"], w.rope_cos_sin, **kw)

    t = w.targets

    def direct():
        torch.ops.pcpkv.dispatch(
            loc["kv"], loc["k_pe"], loc["positions"], wt["kv_norm_w"], w.rope_cos_sin, loc["q_c"], wt["q_norm_w"],
            loc["index_k"], wt["index_ln_w"], wt["index_ln_b"], loc["slot_mapping"], t.table, t.host, None, None,
            loc["q_c_out"], None, None, None, loc["topk"], t.tensors, fmt.kv_format, fmt.ds_mla_scale, fmt.k_scale,
            fmt.has_indexer, 1e-6, 1e-6, 1e-6, True, False, False, "full", 0)

    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4)

    def aten():
        torch.add(a, b, out=c)

    wrapper()
    direct()
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {len(t.tensors)} target tensors")
    for name, fn in (("pk.dispatch (wrapper + op)", wrapper), ("torch.ops.pcpkv.dispatch (op alone)", direct),
                     ("torch.add(out=) for scale", aten)):
        med, best = per_call_us(fn)
        print(f"| {name} | {med:.1f} us median | {best:.1f} us best |")


if __name__ == "__main__":
    main()
