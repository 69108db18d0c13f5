"""A whole model's PCP prefill with one process per rank (issue 16), checked against the single-process run:

    torchrun --standalone --nproc-per-node 4 -m pcpkv_torch.examples.prefill_dist --tokens 512            # CPU
    torchrun --standalone --nproc-per-node 4 -m pcpkv_torch.examples.prefill_dist --device cuda --tokens 8192

Every rank builds the same seeded HF model (transformers >= 5.17, no download; --dims as in
pcpkv_torch.examples.prefill) and runs DistPcpModel (pcpkv_torch.models.dist_world): its PCP rank's rows of every
attention layer, its cache replica in pcpkv symmetric memory (POSIX shm on the CPU; CUDA VMM memory on a GPU,
rank i on cuda:(LOCAL_RANK % GPUs), so N ranks may share one GPU). torch.distributed backend: gloo on the CPU and
when ranks share a GPU (NCCL refuses that), NCCL with one GPU per rank. Per transport it checks: every replica of
every layer byte-identical (each rank reads every rank's replica through its mapping), and on rank 0 the logits
equal the single-process PcpModel's (the same P logical ranks in one process, on the same device) byte for byte
(--no-reference skips that). --check-replicas turns on the run-time replica check. Rank 0 prints; every rank
exits 0 when every check passes, 1 when one fails, 2 for bad arguments, 3 for a failed run (`pcpkv: error: ...`
on stderr, naming a rank that died).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from datetime import timedelta

import torch

from ..models import TRANSPORTS, DistPcpModel, PcpModel, StepRequest, build_hf_model
from ..models.dist_world import MAX_FENCE_TIMEOUT_S
from .prefill import check_shared_args, make_config, run_cli


def parse(argv):
    p = argparse.ArgumentParser(prog="torchrun ... -m pcpkv_torch.examples.prefill_dist",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="glm-5", choices=["glm-5", "deepseek-v3.2"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512, help="prompt length (one request)")
    p.add_argument("--transport", default="all", choices=list(TRANSPORTS) + ["all"])
    p.add_argument("--kv-format", default="fp8_ds_mla", choices=["fp8_ds_mla", "fp8", "bf16"])
    p.add_argument("--dims", choices=["real", "small"], default=None,
                   help="real per-layer dims (default on CUDA) or a small config (default on CPU)")
    p.add_argument("--topk", type=int, default=None, help="index_topk (default: 2048 real, 64 small)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu or cuda (rank i on cuda:(LOCAL_RANK %% GPUs))")
    p.add_argument("--row-chunk", type=int, default=None, help="rows per projection chunk (default 64 CPU, 1024 CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-replicas", action="store_true", help="the run-time replica check after every layer")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds (0.001 to 86400): bootstrap steps, fence waits, collectives")
    p.add_argument("--no-reference", action="store_true", help="skip the single-process comparison on rank 0")
    args = p.parse_args(argv)
    for name in ("layers", "tokens", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} = {getattr(args, name)} must be >= 1")
    check_shared_args(p, args)
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device = {args.device!r}; expected cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device = cuda: no CUDA device is visible to torch")
    if not 1e-3 <= args.timeout <= MAX_FENCE_TIMEOUT_S:  # inf / 1e300 would not convert to a timedelta
        p.error(f"--timeout = {args.timeout} must be in [0.001, {MAX_FENCE_TIMEOUT_S:g}] seconds (one day)")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        p.error("run it under torchrun (RANK / WORLD_SIZE are not set), e.g. "
                "torchrun --standalone --nproc-per-node 4 -m pcpkv_torch.examples.prefill_dist")
    args.dims = args.dims or ("real" if args.device == "cuda" else "small")
    if args.row_chunk is None:
        args.row_chunk = 1024 if args.device == "cuda" else 64
    if args.row_chunk < 0:
        p.error(f"--row-chunk = {args.row_chunk} must be >= 0")
    return args


def main(argv=None) -> int:
    import torch.distributed as dist

    args = parse(argv)
    world, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if args.device == "cuda":
        ngpu = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % ngpu)
        torch.cuda.set_device(device)
        backend = "nccl" if ngpu >= world else "gloo"  # NCCL refuses two ranks on one GPU
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=max(args.timeout * 4, 120)))
    try:
        return run(args, dist, world, device, backend)
    finally:
        # The model's reference cycles held the gloo group until interpreter exit; a gloo worker thread then
        # released a tensor while Python finalized and the rank aborted ("terminate called without an active
        # exception", 5 of 14 runs on 2 cores): collect them, so destroy_process_group joins its threads now.
        gc.collect()
        dist.destroy_process_group()


def run(args, dist, world, device, backend) -> int:
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = make_config(args)
    if args.tokens > cfg.max_position_embeddings:
        raise ValueError(f"--tokens = {args.tokens} exceeds the model's max_position_embeddings")
    model = build_hf_model(cfg, seed=args.seed, device=device)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(args.seed + 1))
    steps = [[StepRequest("prompt", ids)]]
    B = args.block_size
    num_blocks = -(-args.tokens // B) + 2
    kw = dict(num_blocks=num_blocks, block_size=B, kv_format=args.kv_format, seed=args.seed,
              row_chunk=args.row_chunk or None)
    say(f"model {args.model}: {args.layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, kv "
        f"{args.kv_format}; {args.tokens} tokens, {world} rank processes ({backend}), rank 0 on {device}")
    ok = True
    for tr in (list(TRANSPORTS) if args.transport == "all" else [args.transport]):
        pcp = DistPcpModel(model, transport=tr, timeout_s=args.timeout, fence_timeout_s=args.timeout,
                           check_replicas=True if args.check_replicas else None, **kw)
        try:
            t0 = time.perf_counter()
            logits = [pcp.step(s)[0].cpu() for s in steps]
            seconds = time.perf_counter() - t0
            chk = pcp.world.replica_check
            same = True
            for layer in range(args.layers):
                reps = [pcp.world.replica_bytes(layer, r) for r in range(world)]
                same &= all(torch.equal(m, reps[0][0]) and (i is None or torch.equal(i, reps[0][1])) for m, i in reps)
        finally:
            pcp.restore()
            pcp.world.close()
        say(f"  {'PASS' if same else 'FAIL'}  {tr:8s} {world} replicas x {args.layers} layers byte-identical "
            f"(rank 0's view; step {seconds:.3f} s)")
        ok &= same
        if chk.enabled:
            say(f"        {tr:8s} replica check: {chk.seconds / max(chk.layers, 1) * 1e3:.3f} ms per layer on rank 0 "
                f"({chk.layers} layers; hash of the written slots + an all-gather of the hashes; in the step time)")
        if rank == 0 and not args.no_reference:
            ref = PcpModel(model, world, transport=tr, **kw)
            try:
                want = [ref.step(s)[0].cpu() for s in steps]
            finally:
                ref.restore()
            eq = all(torch.equal(a, b) for a, b in zip(logits, want))
            say(f"  {'PASS' if eq else 'FAIL'}  {tr:8s} logits == single-process PCP {world} logits (bit for bit)")
            ok &= eq
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device if backend == "nccl" else "cpu")
    dist.all_reduce(flag)  # every rank exits with the same verdict
    ok = int(flag.item()) == 0
    say(f"\nverdict: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_cli(main, f"rank {os.environ.get('RANK', '?')}: "))
