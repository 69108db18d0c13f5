"""dropin_host_time.py timed in the calling thread's CPU time (docs/perf.md section 39): on a loaded machine the
wall-clock medians include the time the process waits for a core; CPU time counts only the calls' own work.

Usage (from python/, as dropin_host_time.py):
  PYTHONPATH=. ../build/python-venv/bin/pcpkv-python ../docs/results/2026-12-05-cpu/dropin_cpu_time.py [--before F]
--before F: time the drop-in of file F instead (a pcpkv_torch/vllm.py of another commit, e.g.
`git show 6f34418:python/pcpkv_torch/vllm.py > F`, the Python mapping), on the same build of the extension; its
custom op is registered as pcpkv_vllm_before:: so that it does not collide with this build's C++ op.
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def per_call_us(fn, n=2000, rounds=5):
    """op_host_time.per_call_us in thread CPU time: (median, best) of `rounds` x n calls, in us per call."""
    out = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        out.append((time.thread_time() - t0) / n * 1e6)
    return statistics.median(out), min(out)


def load_before(path):
    import pcpkv_torch

    src = open(path).read().replace("pcpkv_vllm::", "pcpkv_vllm_before::").replace("torch.ops.pcpkv_vllm.",
                                                                                    "torch.ops.pcpkv_vllm_before.")
    spec = importlib.util.spec_from_loader("pcpkv_torch.vllm", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "pcpkv_torch"
    sys.modules["pcpkv_torch.vllm"] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    pcpkv_torch.vllm = mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="a pcpkv_torch/vllm.py to time instead of this tree's")
    args = ap.parse_args()
    if args.before:
        load_before(args.before)
    sys.path.insert(0, HERE)
    import dropin_host_time

    dropin_host_time.per_call_us = per_call_us
    dropin_host_time.main()


if __name__ == "__main__":
    main()
