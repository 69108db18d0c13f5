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
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))


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
    import op_host_time  # noqa: E402  its per_call_us (median, best of 5 x 2000 calls) reads op_host_time.time

    op_host_time.time = types.SimpleNamespace(perf_counter=time.thread_time)
    import dropin_host_time  # noqa: E402

    dropin_host_time.main()


if __name__ == "__main__":
    main()
