"""pcpkv's dispatch beside vLLM's DeepSeek-V3.2 fused_norm_rope on the same tensors (issue 34 item 4).

vLLM version measured: 0.34.0 (vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl, sha256
79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2); the run prints the version it loaded.

vLLM's own kernel (``vllm.models.deepseek_v32.common.kernels.fused_norm_rope``; no vLLM code is in this
repository) comes from the installed vLLM package, else from the kernel file that scripts/fetch_vllm_kernel.py
extracted from a vLLM wheel into --vllm-kernel-dir, run with stand-ins for its platform imports
(bench/vllm_kernel_loader.py says which and why). Both run on the same inputs, at the per-GPU size (4096 tokens) and a
whole 32K prefill (32768), GLM-5 and DeepSeek-V3.2 dims: q_c RMSNorm (q_c_out), kv_c RMSNorm + k_pe RoPE + the
fp8_ds_mla cache row, the indexer K LayerNorm + RoPE + its fp8 cache row (UE8M0 scales), and the full top-k fill
(-1 in every row). The call is vLLM's attention's (models/deepseek_v32/attention.py in 0.34.0) without a PCP group:
the indexer cache unshuffled (what DeepseekV32IndexerCache reports on CUDA), indexer_slot_mapping = slot_mapping;
vLLM's attention also passes kv_c_out / k_pe_out, which --kv-out adds to both sides. Each is timed eagerly (one
call between two CUDA events, median of 50) and under a CUDA graph of 20 calls (per call, median of 10 replays).

Bytes compared, from the same poisoned starting caches: MLA kv_c e4m3, its 4 fp32 tile scales, k_pe bf16, indexer
e4m3 and its fp32 scales, q_c_out, the top-k rows (and kv_c_out / k_pe_out with --kv-out). pcpkv writes with the
tile-scale rule of the loaded kernel (--ds-mla-scale auto: vLLM 0.34.0's Triton writer stores power-of-two scales,
2^ceil(log2(max(amax * (1/448), 1e-4))), pcpkv's "pow2"; older vLLM stores the raw amax * (1/448), pcpkv's "raw").
The two sides compute the same formulas with different fp32 reduction orders and, in Triton, approximate
rsqrt / log2 / exp2; so a normalized value may differ in its last fp32 bit. Expected outliers, counted per region
("differing (beyond one step)"): an e4m3 or bf16 byte one code apart where that value lies at a rounding tie; a
tile or indexer scale a factor 2 apart where amax / 448 lies within an ulp of a power of two (its tile's e4m3 bytes
then differ too, by more than one step, counted in the second number); with the raw rule (older vLLM), the last
bit of most scales (multiply by the rounded 1/448 vs division). Top-k rows must be identical.

Usage (from the repo root, on a machine with a CUDA GPU, torch, triton, pcpkv_torch built with CUDA, and vLLM or
build/vllm-kernel from scripts/fetch_vllm_kernel.py):
  python3 bench/vllm_peer.py [--tokens 4096,32768] [--models glm-5,deepseek-v3.2] [--kv-out] [--json out.json]
Without vLLM's kernel (or without a GPU) it prints why it skipped and exits 0.
"""
import argparse
import inspect
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_kernel_loader  # noqa: E402

BLOCK_SIZE, TOPK, GRAPH_CALLS, EAGER_CALLS = 64, 2048, 20, 50
# Arguments of later vLLM versions, passed only where the loaded kernel takes them (value: vLLM's attention's on CUDA)
LATER_ARGS = {"indexer_cache_shuffled": False}
REGIONS = ("mla kv_c e4m3", "mla tile scales", "mla k_pe", "indexer e4m3", "indexer scales", "q_c_out", "top-k rows",
           "kv_c_out", "k_pe_out")


def skip(why: str) -> int:
    print(f"vllm_peer: skipped: {why}")
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4096,32768", help="comma-separated token counts")
    ap.add_argument("--models", default="glm-5,deepseek-v3.2", help="configs/NAME.json, comma-separated")
    ap.add_argument("--vllm-kernel-dir", default=os.path.join(ROOT, "build", "vllm-kernel"),
                    help="where scripts/fetch_vllm_kernel.py put vLLM's kernel file (used when vllm is not importable)")
    ap.add_argument("--ds-mla-scale", default="auto", choices=("auto", "pow2", "raw"),
                    help="pcpkv's fp8_ds_mla tile-scale rule (auto: the loaded vLLM kernel's)")
    ap.add_argument("--kv-out", action="store_true", help="both also write kv_c_out / k_pe_out (as vLLM's attention)")
    ap.add_argument("--dropin", action="store_true",
                    help="also time pcpkv_torch.vllm.fused_norm_rope (the drop-in) on vLLM's arguments, eager and graph, "
                         "and compare its bytes with pcpkv_torch.dispatch's")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens {args.tokens!r}: expected comma-separated integers")
    if any(t < 1 for t in args.tokens):
        ap.error(f"--tokens {args.tokens}: each must be >= 1")
    args.models = args.models.split(",")
    for m in args.models:
        if not os.path.isfile(os.path.join(ROOT, "configs", f"{m}.json")):
            ap.error(f"--models {m!r}: no configs/{m}.json")
    return args


def ds_mla_rule(kernels) -> str:
    """The loaded kernel's fp8_ds_mla tile-scale rule: pow2 where its writer rounds the scale up to a power of two."""
    kernel = kernels._fused_norm_rope_kernel
    src = inspect.getsource(getattr(kernel, "fn", kernel))  # a triton JITFunction wraps the Python function
    return "pow2" if "tl.math.exp2(tl.math.ceil(tl.math.log2(tile_scale)))" in src else "raw"


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


def inputs(torch, pk, spec, T: int, seed: int, kv_out: bool, device="cuda"):
    """vLLM's argument set for T tokens (as its DSV32 attention builds them: q_c / kv_c / k_pe split from one
    projection output), seeded, with distinct slots and a few padding tokens; outputs poisoned."""
    gen = torch.Generator().manual_seed(seed)
    q_rank = spec.q_lora_rank
    qkv = (torch.randn(T, q_rank + 512 + 64, generator=gen) * 2).to(torch.bfloat16).to(device)
    q_c, kv_c, k_pe = qkv.split([q_rank, 512, 64], dim=-1)
    index_k = (torch.randn(T, 128, generator=gen) * 2).to(torch.bfloat16).to(device)
    num_pos = T + 64
    table = pk.rope_table(spec.rope, num_pos, device)
    num_blocks = (T + BLOCK_SIZE - 1) // BLOCK_SIZE + 2
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:7]] = -1
    w = lambda n: (1.0 + 0.1 * torch.randn(n, generator=gen)).to(device)  # noqa: E731
    a = dict(positions=torch.randperm(num_pos, generator=gen)[:T].to(device), q_c=q_c,
             q_rms_norm_w=w(q_rank).to(torch.bfloat16), q_rms_eps=spec.rms_norm_eps, kv_c=kv_c,
             kv_rms_norm_w=w(512).to(torch.bfloat16), kv_rms_eps=spec.rms_norm_eps, k_pe=k_pe,
             k_rope_cos_sin_cache=table, index_k=index_k, index_k_layer_norm_w=w(128),
             index_k_layer_norm_bias=0.1 * w(128), index_k_layer_norm_eps=spec.index_norm_eps,
             index_k_rope_cos_sin_cache=table.clone(),
             topk_indices_buffer=torch.zeros(T, TOPK, dtype=torch.int32, device=device),
             slot_mapping=slots.to(device),
             indexer_k_cache=torch.full((num_blocks, BLOCK_SIZE, 132), 0xA5, dtype=torch.uint8, device=device),
             mla_kv_cache=torch.full((num_blocks, BLOCK_SIZE, 656), 0xA5, dtype=torch.uint8, device=device),
             mla_kv_cache_dtype="fp8_ds_mla", has_indexer=True,
             # a tensor, as vLLM's attention passes its _k_scale: None would make vLLM allocate and fill one per
             # call (a memset in every captured call); unused by fp8_ds_mla on both sides
             mla_k_scale=torch.ones(1, dtype=torch.float32, device=device),
             index_rope_interleave=spec.indexer_rope_interleave,
             q_c_out=torch.full((T, q_rank), 7, dtype=torch.bfloat16, device=device))
    if kv_out:
        a["kv_c_out"] = torch.full((T, 512), 7, dtype=torch.bfloat16, device=device)
        a["k_pe_out"] = torch.full((T, 64), 7, dtype=torch.bfloat16, device=device)
    return a


OUTPUTS = ("topk_indices_buffer", "indexer_k_cache", "mla_kv_cache", "q_c_out", "kv_c_out", "k_pe_out")


def outputs_copy(a):
    b = dict(a)
    for k in OUTPUTS:
        if k in a:
            b[k] = a[k].clone()
    return b


def vllm_kwargs(fn, a) -> dict:
    """a's arguments as the loaded fused_norm_rope takes them: LATER_ARGS where its signature has them; raises
    naming an argument the kernel lacks or requires beyond a."""
    params = inspect.signature(fn).parameters
    kw = dict(a)
    kw.update({k: v for k, v in LATER_ARGS.items() if k in params})
    lacks = [k for k in kw if k not in params]
    if lacks:
        raise vllm_kernel_loader.Unavailable(f"this vLLM's fused_norm_rope has no {lacks} (--kv-out needs kv_c_out / "
                                             "k_pe_out)")
    needs = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kw]
    if needs:
        raise vllm_kernel_loader.Unavailable(f"this vLLM's fused_norm_rope requires {needs}, which this script "
                                             "does not know")
    return kw


def pcpkv_call(torch, pk, a, rule: str):
    """pcpkv_torch.dispatch doing vLLM's work on a's tensors (weights converted once, outside the timed call)."""
    fmt = pk.CacheFormat("fp8_ds_mla", rule, has_indexer=True)
    targets = pk.CacheTargets.from_caches([a["mla_kv_cache"]], [a["indexer_k_cache"]], fmt)
    f32 = {k: a[k].float().contiguous() for k in ("q_rms_norm_w", "kv_rms_norm_w", "index_k_layer_norm_w",
                                                  "index_k_layer_norm_bias")}

    def call():
        pk.dispatch(a["kv_c"], a["k_pe"], a["positions"], f32["kv_rms_norm_w"], a["k_rope_cos_sin_cache"], fmt=fmt,
                    q_c=a["q_c"], q_norm_w=f32["q_rms_norm_w"], q_c_out=a["q_c_out"], index_k=a["index_k"],
                    index_ln_w=f32["index_k_layer_norm_w"], index_ln_b=f32["index_k_layer_norm_bias"],
                    slot_mapping=a["slot_mapping"], targets=targets, topk_fill=a["topk_indices_buffer"],
                    kv_c_out=a.get("kv_c_out"), k_pe_out=a.get("k_pe_out"),
                    q_eps=a["q_rms_eps"], kv_eps=a["kv_rms_eps"], index_eps=a["index_k_layer_norm_eps"],
                    index_rope_interleaved=a["index_rope_interleave"])
    return call


def dropin_row(torch, a, p, rule: str, vllm_eager: float, pcpkv_eager: float) -> dict:
    """pcpkv_torch.vllm.fused_norm_rope (the drop-in) on vLLM's own keyword arguments (a, from the same starting
    bytes), writing the loaded kernel's tile-scale rule: its eager and graph time, and whether every output byte
    equals what pcpkv_torch.dispatch wrote into p (the same kernel: they must be equal)."""
    from pcpkv_torch import vllm as pkv
    d = outputs_copy(a)
    kw = dict(d, ds_mla_scale=rule)
    call = lambda: pkv.fused_norm_rope(**kw)  # noqa: E731
    call()
    torch.cuda.synchronize()
    equal = all(torch.equal(d[k], p[k]) for k in OUTPUTS if k in d)
    return dict(eager_us=median_us(torch, call, EAGER_CALLS), graph_us=graph_us(torch, call), bytes_equal=equal)


def diff_stats(torch, x, y, kind: str):
    """(differing elements, of them beyond one step): e4m3 / bf16 codes of one sign one apart are one step; any
    differing fp32 scale or int32 entry is beyond it."""
    if kind == "e4m3":
        x, y = x.contiguous().view(torch.uint8).to(torch.int32), y.contiguous().view(torch.uint8).to(torch.int32)
        sign = 0x80
    elif kind == "bf16":
        x, y = x.contiguous().view(torch.int16).to(torch.int32), y.contiguous().view(torch.int16).to(torch.int32)
        sign = -0x8000  # int16 sign bit
    else:
        x, y = x.contiguous().view(torch.int32), y.contiguous().view(torch.int32)
        sign = None
    ne = x != y
    if sign is None:
        beyond = ne
    else:
        same_sign = (x & sign) == (y & sign)
        beyond = ne & ~(same_sign & ((x - y).abs() <= 1))
    return int(ne.sum()), int(beyond.sum())


def compare(torch, v, p) -> dict:
    """Per region (differing, beyond one step): v written by vLLM, p by pcpkv, from the same starting bytes."""
    mv, mp = v["mla_kv_cache"], p["mla_kv_cache"]
    iv, ip = v["indexer_k_cache"].flatten(1), p["indexer_k_cache"].flatten(1)
    data = BLOCK_SIZE * 128
    out = {"mla kv_c e4m3": diff_stats(torch, mv[..., :512], mp[..., :512], "e4m3"),
           "mla tile scales": diff_stats(torch, mv[..., 512:528], mp[..., 512:528], "fp32"),
           "mla k_pe": diff_stats(torch, mv[..., 528:], mp[..., 528:], "bf16"),
           "indexer e4m3": diff_stats(torch, iv[:, :data], ip[:, :data], "e4m3"),
           "indexer scales": diff_stats(torch, iv[:, data:], ip[:, data:], "fp32"),
           "q_c_out": diff_stats(torch, v["q_c_out"], p["q_c_out"], "bf16"),
           "top-k rows": diff_stats(torch, v["topk_indices_buffer"], p["topk_indices_buffer"], "int32")}
    for k in ("kv_c_out", "k_pe_out"):
        if k in v:
            out[k] = diff_stats(torch, v[k], p[k], "bf16")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError as e:
        return skip(f"torch is not installed ({e})")
    try:
        vllm_fused_norm_rope, kernels, how = vllm_kernel_loader.load(args.vllm_kernel_dir)
    except vllm_kernel_loader.Unavailable as e:
        return skip(str(e))
    print(f"vLLM's fused_norm_rope: {how}")
    rule = ds_mla_rule(kernels) if args.ds_mla_scale == "auto" else args.ds_mla_scale
    source = "the loaded kernel's" if args.ds_mla_scale == "auto" else "--ds-mla-scale"
    print(f"fp8_ds_mla tile scales: pcpkv writes {rule!r} ({source})")
    if not torch.cuda.is_available():
        return skip("no CUDA device (vLLM's kernel is Triton on CUDA)")
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import pcpkv_torch as pk
    if pk.ops.cuda_dispatch_impl() != "pcpkv":
        return skip("pcpkv_torch is a CPU-only build (PCPKV_TORCH_CUDA=0)")
    import triton
    platform = getattr(kernels, "current_platform", None)
    pdl = platform.is_arch_support_pdl() if platform is not None else "?"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"vLLM PDL launch: {pdl}\n")
    regions = [r for r in REGIONS if args.kv_out or r not in ("kv_c_out", "k_pe_out")]
    print("| model | tokens | vLLM eager us | pcpkv eager us | eager vLLM/pcpkv | vLLM graph us | pcpkv graph us | "
          "graph vLLM/pcpkv | differing (beyond one step): " + " / ".join(regions) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for model in args.models:
        with open(os.path.join(ROOT, "configs", f"{model}.json")) as f:
            spec = pk.ModelSpec.from_hf_config(json.load(f))
        for T in args.tokens:
            a = inputs(torch, pk, spec, T, seed=T, kv_out=args.kv_out)
            v, p = outputs_copy(a), outputs_copy(a)
            try:
                vkw = vllm_kwargs(vllm_fused_norm_rope, v)
            except vllm_kernel_loader.Unavailable as e:
                return skip(str(e))
            vcall = lambda: vllm_fused_norm_rope(**vkw)  # noqa: E731
            pcall = pcpkv_call(torch, pk, p, rule)
            vcall()
            pcall()
            torch.cuda.synchronize()
            diff = compare(torch, v, p)
            ve, pe = median_us(torch, vcall, EAGER_CALLS), median_us(torch, pcall, EAGER_CALLS)
            vg, pg = graph_us(torch, vcall), graph_us(torch, pcall)
            rows.append(dict(model=model, tokens=T, vllm=how, ds_mla_scale=rule, vllm_eager_us=ve, pcpkv_eager_us=pe,
                             vllm_graph_us=vg, pcpkv_graph_us=pg, differing=diff,
                             elements={r: v_n for r, v_n in zip(regions, _sizes(v, regions))}))
            d = " / ".join(f"{diff[r][0]} ({diff[r][1]})" for r in regions)
            print(f"| {model} | {T} | {ve:.1f} | {pe:.1f} | {ve / pe:.2f}x | {vg:.1f} | {pg:.1f} | {vg / pg:.2f}x | "
                  f"{d} |", flush=True)
            if args.dropin:
                rows[-1]["dropin"] = dropin_row(torch, a, p, rule, ve, pe)
            del a, v, p, vkw
            torch.cuda.empty_cache()
    if args.dropin:
        print("\n| model | tokens | drop-in eager us | drop-in graph us | drop-in / pcpkv_torch.dispatch eager | "
              "vLLM / drop-in eager | bytes equal to pcpkv_torch.dispatch's |\n|---|---|---|---|---|---|---|")
        for r in rows:
            d = r["dropin"]
            print(f"| {r['model']} | {r['tokens']} | {d['eager_us']:.1f} | {d['graph_us']:.1f} | "
                  f"{d['eager_us'] / r['pcpkv_eager_us']:.2f}x | {r['vllm_eager_us'] / d['eager_us']:.2f}x | "
                  f"{d['bytes_equal']} |")
    print("\nregion sizes (elements): " + "; ".join(
        f"{r['model']} {r['tokens']}: " + ", ".join(f"{k} {n}" for k, n in r["elements"].items()) for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _sizes(v, regions):
    """Elements compared per region (e4m3 / scale / bf16 / int32 units, every cache row, written or not)."""
    mla, idx = v["mla_kv_cache"], v["indexer_k_cache"]
    rows, idx_blocks = mla.shape[0] * mla.shape[1], idx.shape[0]
    n = {"mla kv_c e4m3": rows * 512, "mla tile scales": rows * 4, "mla k_pe": rows * 64,
         "indexer e4m3": idx_blocks * BLOCK_SIZE * 128, "indexer scales": idx_blocks * BLOCK_SIZE,
         "q_c_out": v["q_c_out"].numel(), "top-k rows": v["topk_indices_buffer"].numel(),
         "kv_c_out": v.get("kv_c_out", v["q_c_out"]).numel(), "k_pe_out": v.get("k_pe_out", v["q_c_out"]).numel()}
    return [n[r] for r in regions]


if __name__ == "__main__":
    sys.exit(main())
