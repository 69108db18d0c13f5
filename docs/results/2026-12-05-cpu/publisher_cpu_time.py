"""Host time of one VllmPcpPublisher.publish() call against pcpkv_torch.dispatch + fence on the same work (issue 35
item 4, "the same for the new entry point of item 2"), in the calling thread's CPU time (as dropin_cpu_time.py).

Usage (from python/):
  PYTHONPATH=. ../build/python-venv/bin/pcpkv-python ../docs/results/2026-12-05-cpu/publisher_cpu_time.py [--profile]
One rank (a gloo group of 1), CPU caches in shared memory, fp8_ds_mla, a layer with an indexer and one without,
transport direct, check=False (the per-call exchange off, as under CUDA graphs), T = 1 local token (vLLM's argument
shapes: q_c / kv_c / k_pe splits of one projection). Medians of 5 x 1000 calls. --profile: cProfile of 2000
publish() calls of the indexer layer, the top 25 entries by own time.
"""
import argparse
import os
import sys
import tempfile
import time
import types

sys.path.insert(0, "tests")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import op_host_time  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import pcpkv_torch as pk  # noqa: E402
from pcpkv_torch.vllm import VllmPcpPublisher  # noqa: E402

Q_LORA, T, BLOCKS, BS = 64, 1, 8, 16


def per_call_us(fn):
    """Median of 5 x 1000 calls in thread CPU time (op_host_time's timing, read through thread_time as
    dropin_cpu_time.py does)."""
    return op_host_time.per_call_us(fn, n=1000)[0]


def main():
    op_host_time.time = types.SimpleNamespace(perf_counter=time.thread_time)
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "init"), rank=0,
                            world_size=1)
    gen = torch.Generator().manual_seed(3)
    mla = [torch.zeros((BLOCKS, BS, 656), dtype=torch.uint8).share_memory_() for _ in range(2)]
    idx = [torch.zeros((BLOCKS, BS, 132), dtype=torch.uint8).share_memory_(), None]
    pub = VllmPcpPublisher(mla, idx, kv_cache_dtype="fp8_ds_mla", max_num_tokens=T, transport="direct", check=False)
    qkv = torch.randn((T, Q_LORA + 576), generator=gen).to(torch.bfloat16)
    q_c, kv, pe = qkv[:, :Q_LORA], qkv[:, Q_LORA:Q_LORA + 512], qkv[:, Q_LORA + 512:]
    ik = torch.randn((T, 128), generator=gen).to(torch.bfloat16)
    w = {k: (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)
         for k, n in (("q", Q_LORA), ("kv", 512), ("ln_w", 128), ("ln_b", 128))}
    rope = pk.rope_table(pk.RopeSpec("deepseek_yarn", 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0), 64, "cpu")
    pos = torch.tensor([5] * T, dtype=torch.int64)
    sm = torch.tensor([BS + 5] * T, dtype=torch.int64)
    topk = torch.zeros((T, 32), dtype=torch.int32)
    q_out = torch.empty((T, Q_LORA), dtype=torch.bfloat16)
    ec = pub.caches
    f32 = {k: v.float() for k, v in w.items()}
    for layer, has in ((0, True), (1, False)):
        fmt = pub.fmts[layer]

        def publish():
            pub.publish(layer, pos, q_c, w["q"], 1e-6, kv, w["kv"], 1e-6, pe, rope, ik if has else None,
                        w["ln_w"] if has else None, w["ln_b"] if has else None, 1e-6, rope if has else None,
                        topk if has else None, sm, 0, q_c_out=q_out)

        def plain():
            pk.dispatch(kv, pe, pos, f32["kv"], rope, fmt=fmt, q_c=q_c, q_norm_w=f32["q"], q_c_out=q_out,
                        index_k=ik if has else None, index_ln_w=f32["ln_w"] if has else None,
                        index_ln_b=f32["ln_b"] if has else None, topk_fill=topk if has else None, q_eps=1e-6,
                        kv_eps=1e-6, index_eps=1e-6, slot_mapping=sm, targets=ec.targets[layer])
            pk.fence(ec.fence_state, 0, timeout_us=30_000_000, written=ec.mla[layer] + (ec.index[layer] or []))

        publish()
        plain()
        if args.profile and has:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                publish()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        ours, base = per_call_us(publish), per_call_us(plain)
        print(f"| layer {layer} ({'indexer' if has else 'no indexer'}) | publish {ours:.1f} us | dispatch + fence "
              f"{base:.1f} us | {ours / base:.2f}x |")
    pub.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
