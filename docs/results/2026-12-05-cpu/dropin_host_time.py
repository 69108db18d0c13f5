"""Host time of one pcpkv_torch.vllm.fused_norm_rope call against pcpkv_torch.dispatch on the same work (perf.md 37).

Usage (from python/):
  PYTHONPATH=. ../build/python-venv/bin/pcpkv-python ../docs/results/2026-12-05-cpu/dropin_host_time.py
CPU tensors, fp8_ds_mla + indexer, vLLM's argument shapes (tests/test_vllm_dropin.py vllm_inputs) with T tokens;
T = 0 times the host path alone, T = 1 adds one token of the CPU kernel. Medians of 5 x 2000 calls, one thread.
"""
import os
import sys

sys.path.insert(0, "tests")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import test_vllm_dropin as d  # noqa: E402
from op_host_time import per_call_us  # noqa: E402  (median, best) of 5 x 2000 calls
from pcpkv_torch.vllm import fused_norm_rope  # noqa: E402

pk = d.pk


def main():
    torch.set_num_threads(1)
    for T in (0, 1):
        a = d.vllm_inputs("cpu", "fp8_ds_mla")
        for k in ("positions", "q_c", "kv_c", "k_pe", "index_k", "slot_mapping", "q_c_out"):
            a[k] = a[k][:T]
        a["slot_mapping"] = a["slot_mapping"].clone().fill_(3)
        fmt = pk.CacheFormat("fp8_ds_mla", "raw", has_indexer=True)
        targets = pk.CacheTargets.from_caches([a["mla_kv_cache"]], [a["indexer_k_cache"]], fmt)
        rope = a["k_rope_cos_sin_cache"].float()
        w = {k: a[k].float().contiguous() for k in ("q_rms_norm_w", "kv_rms_norm_w", "index_k_layer_norm_w",
                                                   "index_k_layer_norm_bias")}
        topk = a["topk_indices_buffer"][:T]

        def dropin():
            fused_norm_rope(**a)

        def direct():
            pk.dispatch(a["kv_c"], a["k_pe"], a["positions"], w["kv_rms_norm_w"], rope, fmt=fmt, q_c=a["q_c"],
                        q_norm_w=w["q_rms_norm_w"], q_c_out=a["q_c_out"], index_k=a["index_k"],
                        index_ln_w=w["index_k_layer_norm_w"], index_ln_b=w["index_k_layer_norm_bias"],
                        slot_mapping=a["slot_mapping"], targets=targets, topk_fill=topk, kv_eps=1e-5)

        dropin()
        direct()
        ours, plain = per_call_us(dropin)[0], per_call_us(direct)[0]
        print(f"| T = {T} | drop-in {ours:.1f} us | pcpkv_torch.dispatch {plain:.1f} us |")


if __name__ == "__main__":
    main()
