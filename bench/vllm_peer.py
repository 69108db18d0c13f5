"""pcpkv's dispatch beside vLLM's DeepSeek-V3.2 fused_norm_rope on the same tensors (issue 34 item 4).

For users who have vLLM: imports vLLM's own kernel (``vllm.models.deepseek_v32.common.kernels.fused_norm_rope``;
no vLLM code is in this repository) and runs it and ``pcpkv_torch.dispatch`` on the same inputs, at the per-GPU
size (4096 tokens) and a whole 32K prefill (32768), GLM-5 and DeepSeek-V3.2 dims, fp8_ds_mla with the indexer
cache and the full top-k fill (-1 in every row, as vLLM does). Each is timed eagerly (one call between two CUDA
events, median) and under a CUDA graph of 20 calls (per call), and the written bytes are compared: the MLA cache
(kv_c e4m3, the 4 tile scales, k_pe), the indexer cache (e4m3 and UE8M0 scales), q_c_out and the top-k rows.
pcpkv uses the "raw" fp8_ds_mla scale rule; vLLM's Triton writer multiplies by 1/448 where pcpkv divides, so some
tile scales differ in their last bit and an e4m3 byte at a rounding tie may differ by one code
(pcpkv_torch/vllm.py names this difference); every other byte must be equal.

Usage (from the repo root, on a machine with a CUDA GPU, torch, vLLM and pcpkv_torch built with CUDA):
  python3 bench/vllm_peer.py [--tokens 4096,32768] [--models glm-5,deepseek-v3.2] [--json out.json]
Without vLLM (or without a GPU) it prints why it skipped and exits 0.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_KERNEL = "vllm.models.deepseek_v32.common.kernels"
BLOCK_SIZE, TOPK, GRAPH_CALLS, EAGER_CALLS = 64, 2048, 20, 50


def skip(why: str) -> int:
    print(f"vllm_peer: skipped: {why}")
    return 0


def median_us(torch, fn, calls: int) -> float:
    """Median of `calls` single calls, each between two CUDA events (host path included when it is the longer)."""
    times = []
    for _ in range(calls + 3):
        b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        b.record()
        fn()
        e.record()
        e.synchronize()
        times.append(b.elapsed_time(e) * 1e3)
    times = sorted(times[3:])
    return times[len(times) // 2]


def graph_us(torch, fn) -> float:
    """Per call of a CUDA graph of GRAPH_CALLS calls (median of 10 replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm up on the capture stream (Triton compiles, pcpkv's first-call checks)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn()
    return median_us(torch, g.replay, 10) / GRAPH_CALLS


def inputs(torch, pk, spec, T: int, seed: int):
    """vLLM's argument set for T tokens (as its DSV32 attention builds them: q_c / kv_c / k_pe split from one
    projection output), seeded, with distinct slots and a few padding tokens."""
    gen = torch.Generator().manual_seed(seed)
    q_rank = spec.q_lora_rank
    qkv = (torch.randn(T, q_rank + 512 + 64, generator=gen) * 2).to(torch.bfloat16).cuda()
    q_c, kv_c, k_pe = qkv.split([q_rank, 512, 64], dim=-1)
    index_k = (torch.randn(T, 128, generator=gen) * 2).to(torch.bfloat16).cuda()
    num_pos = T + 64
    table = pk.rope_table(spec.rope, num_pos, "cuda")
    num_blocks = (T + BLOCK_SIZE - 1) // BLOCK_SIZE + 2
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:7]] = -1
    w = lambda n: (1.0 + 0.1 * torch.randn(n, generator=gen)).cuda()  # noqa: E731
    return dict(positions=torch.randperm(num_pos, generator=gen)[:T].cuda(), q_c=q_c,
                q_rms_norm_w=w(q_rank).to(torch.bfloat16), q_rms_eps=spec.rms_norm_eps, kv_c=kv_c,
                kv_rms_norm_w=w(512).to(torch.bfloat16), kv_rms_eps=spec.rms_norm_eps, k_pe=k_pe,
                k_rope_cos_sin_cache=table, index_k=index_k, index_k_layer_norm_w=w(128),
                index_k_layer_norm_bias=0.1 * w(128), index_k_layer_norm_eps=spec.index_norm_eps,
                index_k_rope_cos_sin_cache=table.clone(),
                topk_indices_buffer=torch.zeros(T, TOPK, dtype=torch.int32, device="cuda"),
                slot_mapping=slots.cuda(),
                indexer_k_cache=torch.full((num_blocks, BLOCK_SIZE, 132), 0xA5, dtype=torch.uint8, device="cuda"),
                mla_kv_cache=torch.full((num_blocks, BLOCK_SIZE, 656), 0xA5, dtype=torch.uint8, device="cuda"),
                mla_kv_cache_dtype="fp8_ds_mla", mla_k_scale=None, has_indexer=True,
                index_rope_interleave=spec.indexer_rope_interleave,
                q_c_out=torch.full((T, q_rank), 7, dtype=torch.bfloat16, device="cuda"))


def outputs_copy(a):
    b = dict(a)
    for k in ("topk_indices_buffer", "indexer_k_cache", "mla_kv_cache", "q_c_out"):
        b[k] = a[k].clone()
    return b


def pcpkv_call(torch, pk, a):
    """pcpkv_torch.dispatch doing vLLM's work on a's tensors (weights converted once, outside the timed call)."""
    fmt = pk.CacheFormat("fp8_ds_mla", "raw", has_indexer=True)
    targets = pk.CacheTargets.from_caches([a["mla_kv_cache"]], [a["indexer_k_cache"]], fmt)
    f32 = {k: a[k].float().contiguous() for k in ("q_rms_norm_w", "kv_rms_norm_w", "index_k_layer_norm_w",
                                                  "index_k_layer_norm_bias")}

    def call():
        pk.dispatch(a["kv_c"], a["k_pe"], a["positions"], f32["kv_rms_norm_w"], a["k_rope_cos_sin_cache"], fmt=fmt,
                    q_c=a["q_c"], q_norm_w=f32["q_rms_norm_w"], q_c_out=a["q_c_out"], index_k=a["index_k"],
                    index_ln_w=f32["index_k_layer_norm_w"], index_ln_b=f32["index_k_layer_norm_bias"],
                    slot_mapping=a["slot_mapping"], targets=targets, topk_fill=a["topk_indices_buffer"],
                    q_eps=a["q_rms_eps"], kv_eps=a["kv_rms_eps"], index_eps=a["index_k_layer_norm_eps"],
                    index_rope_interleaved=a["index_rope_interleave"])
    return call


def differing(torch, x, y) -> int:
    return int((x.view(torch.uint8) != y.view(torch.uint8)).sum())


def compare(torch, v, p) -> dict:
    """Differing bytes per region: v written by vLLM, p by pcpkv, from the same starting bytes."""
    mv, mp = v["mla_kv_cache"], p["mla_kv_cache"]
    iv, ip = v["indexer_k_cache"].flatten(1), p["indexer_k_cache"].flatten(1)
    data = BLOCK_SIZE * 128
    return {"mla kv_c e4m3": differing(torch, mv[..., :512], mp[..., :512]),
            "mla tile scales": differing(torch, mv[..., 512:528], mp[..., 512:528]),
            "mla k_pe": differing(torch, mv[..., 528:], mp[..., 528:]),
            "indexer e4m3": differing(torch, iv[:, :data], ip[:, :data]),
            "indexer scales": differing(torch, iv[:, data:], ip[:, data:]),
            "q_c_out": differing(torch, v["q_c_out"], p["q_c_out"]),
            "top-k rows": differing(torch, v["topk_indices_buffer"], p["topk_indices_buffer"]),
            "cache bytes": mv.numel() + iv.numel()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--models", default="glm-5,deepseek-v3.2")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        return skip(f"torch is not installed ({e})")
    try:
        vllm_kernels = __import__(VLLM_KERNEL, fromlist=["fused_norm_rope"])
        vllm_fused_norm_rope = vllm_kernels.fused_norm_rope
    except Exception as e:  # ImportError, or a vLLM without that module / function
        return skip(f"vLLM's fused_norm_rope cannot be imported from {VLLM_KERNEL} ({type(e).__name__}: {e}); "
                    f"install a vLLM that has it to compare")
    if not torch.cuda.is_available():
        return skip("no CUDA device (vLLM's kernel is Triton on CUDA)")
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import pcpkv_torch as pk
    if pk.ops.cuda_dispatch_impl() != "pcpkv":
        return skip("pcpkv_torch is a CPU-only build (PCPKV_TORCH_CUDA=0)")
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| model | tokens | vLLM eager us | pcpkv eager us | eager ratio | vLLM graph us | pcpkv graph us | "
          "graph ratio | differing bytes (kv_c / scales / k_pe / indexer / indexer scales / q_c_out / top-k) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        with open(os.path.join(ROOT, "configs", f"{model}.json")) as f:
            spec = pk.ModelSpec.from_hf_config(json.load(f))
        for T in (int(t) for t in args.tokens.split(",")):
            a = inputs(torch, pk, spec, T, seed=T)
            v, p = outputs_copy(a), outputs_copy(a)
            vcall = lambda: vllm_fused_norm_rope(**v)  # noqa: E731
            pcall = pcpkv_call(torch, pk, p)
            vcall()
            pcall()
            torch.cuda.synchronize()
            diff = compare(torch, v, p)
            ve, pe = median_us(torch, vcall, EAGER_CALLS), median_us(torch, pcall, EAGER_CALLS)
            vg, pg = graph_us(torch, vcall), graph_us(torch, pcall)
            rows.append(dict(model=model, tokens=T, vllm_eager_us=ve, pcpkv_eager_us=pe, vllm_graph_us=vg,
                             pcpkv_graph_us=pg, differing_bytes=diff))
            d = " / ".join(str(diff[k]) for k in ("mla kv_c e4m3", "mla tile scales", "mla k_pe", "indexer e4m3",
                                                  "indexer scales", "q_c_out", "top-k rows"))
            print(f"| {model} | {T} | {ve:.1f} | {pe:.1f} | {ve / pe:.2f}x | {vg:.1f} | {pg:.1f} | {vg / pg:.2f}x | "
                  f"{d} of {diff['cache bytes']} cache bytes |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
