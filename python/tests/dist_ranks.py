"""Runs a function on W rank processes of a gloo torch.distributed group (spawned, CPU) and collects what each
returns or raises, with a bounded wait: a test never hangs on a stuck rank."""

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback


def _entry(fn, rank, world, init_file, env, q, args):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        # Plain pickle bytes: the queue's own pickler would pass a tensor's storage as a file descriptor that the
        # parent fetches from this process later, which fails once the rank has exited (FileNotFoundError).
        q.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # reported to the test, which judges it
        q.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn, world, *args, timeout=60.0, env=None):
    """{rank: ("ok", value) | ("err", "Type: message ...")} of fn(rank, world, *args) on every rank; a rank that
    exited without reporting gets ("exit", exitcode). fn must be a module-level function."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init_file, dict(env or {}), q, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = {}
        import time
        deadline = time.monotonic() + timeout
        while len(out) < world and time.monotonic() < deadline:
            try:
                r, kind, val = q.get(timeout=0.2)
                out[r] = (kind, pickle.loads(val) if kind == "ok" else val)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
        for r, p in enumerate(procs):
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
            out.setdefault(r, ("exit", p.exitcode))
    return out
