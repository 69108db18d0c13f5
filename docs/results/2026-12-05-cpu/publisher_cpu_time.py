"""Host time of one VllmPcpPublisher.publish() call against the same ops called through pcpkv_torch's wrappers on the
same work (issue 35 item 4, "the same for the new entry point of item 2"), in the calling thread's CPU time (as
dropin_cpu_time.py).

Usage (from python/):
  PYTHONPATH=. ../build/python-venv/bin/pcpkv-python ../docs/results/2026-12-05-cpu/publisher_cpu_time.py \
      [--transport direct|staging|collect] [--check] [--before F] [--profile]
One rank (a gloo group of 1), CPU caches in shared memory, fp8_ds_mla, a layer with an indexer and one without,
T = 1 local token (vLLM's argument shapes: q_c / kv_c / k_pe splits of one projection). Medians of 5 x 1000 calls.
The baseline per transport: direct dispatch + fence; staging dispatch (row_dests) + fence + combine; collect
dispatch (bf16 outputs) + the three all-gathers + insert. --check: the publisher with check=True (its per-call
verdict exchange, an object all-gather, is part of what is timed; the baseline is the same). --before F: time the
publisher of file F instead (a pcpkv_torch/vllm_publish.py of another commit, e.g. `git show
b19575a:python/pcpkv_torch/vllm_publish.py > F`) on the same build of the extension. --profile: cProfile of 2000
publish() calls of the indexer layer, the top 25 entries by own time.
"""
import argparse
import importlib.util
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

Q_LORA, T, BLOCKS, BS = 64, 1, 8, 16


def per_call_us(fn):
    """Median of 5 x 1000 calls in thread CPU time (op_host_time's timing, read through thread_time as
    dropin_cpu_time.py does)."""
    return op_host_time.per_call_us(fn, n=1000)[0]


def publisher_class(before):
    if not before:
        from pcpkv_torch.vllm import VllmPcpPublisher
        return VllmPcpPublisher
    spec = importlib.util.spec_from_loader("pcpkv_torch.vllm_publish_before", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "pcpkv_torch"
    exec(compile(open(before).read(), before, "exec"), mod.__dict__)
    return mod.VllmPcpPublisher


def main():
    op_host_time.time = types.SimpleNamespace(perf_counter=time.thread_time)
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="direct", choices=("direct", "staging", "collect"))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--before")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "init"), rank=0,
                            world_size=1)
    gen = torch.Generator().manual_seed(3)
    mla = [torch.zeros((BLOCKS, BS, 656), dtype=torch.uint8).share_memory_() for _ in range(2)]
    idx = [torch.zeros((BLOCKS, BS, 132), dtype=torch.uint8).share_memory_(), None]
    pub = publisher_class(args.before)(mla, idx, kv_cache_dtype="fp8_ds_mla", max_num_tokens=T,
                                       transport=args.transport, check=args.check)
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

        kw = dict(fmt=fmt, q_c=q_c, q_norm_w=f32["q"], q_c_out=q_out, index_k=ik if has else None,
                  index_ln_w=f32["ln_w"] if has else None, index_ln_b=f32["ln_b"] if has else None,
                  topk_fill=topk if has else None, q_eps=1e-6, kv_eps=1e-6, index_eps=1e-6)

        def direct():
            pk.dispatch(kv, pe, pos, f32["kv"], rope, slot_mapping=sm, targets=ec.targets[layer], **kw)
            pk.fence(ec.fence_state, 0, timeout_us=30_000_000, written=ec.mla[layer] + (ec.index[layer] or []))

        def staging():
            ws, dests = ec.staging_for(fmt, T)
            pk.dispatch(kv, pe, pos, f32["kv"], rope, row_dests=dests[0], **kw)
            pk.fence(ec.fence_state, 0, timeout_us=30_000_000, written=ws)
            pk.combine(ws[0][0, 0], sm, mla[layer], idx[layer], fmt=fmt)

        def collect():
            outs = [torch.empty((T, n), dtype=torch.bfloat16) for n in ((512, 64, 128) if has else (512, 64))]
            pk.dispatch(kv, pe, pos, f32["kv"], rope, kv_c_out=outs[0], k_pe_out=outs[1],
                        index_k_out=outs[2] if has else None, **kw)
            rows = []
            for o in outs:
                got = [torch.empty_like(o)]
                dist.all_gather(got, o)
                rows.append(torch.cat(got))
            pk.insert(rows[0], rows[1], rows[2] if has else None, sm, mla[layer], idx[layer], fmt=fmt)

        plain = {"direct": direct, "staging": staging, "collect": collect}[args.transport]
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
        mode = args.transport + (" check" if args.check else "")
        print(f"| {mode} | layer {layer} ({'indexer' if has else 'no indexer'}) | publish {ours:.1f} us | ops "
              f"through the wrappers {base:.1f} us | {ours / base:.2f}x |")
    pub.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
