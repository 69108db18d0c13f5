"""Fake (meta) kernels of the mutating ops, so torch.compile / FakeTensor tracing and CUDA-graph capture
through torch.compile can handle them: they return nothing and allocate nothing (all outputs are
caller-provided, marked mutable in the schemas).

The same function is the ops' Meta kernel, which the dispatcher picks as soon as ONE tensor argument is on the
meta device: a meta kv_norm_w among CPU tensors ran it, and the call did nothing and raised nothing. So it checks
the devices the real ops check (every tensor on the reference argument's device, host tables on the CPU, the
`written` lists on its device type), naming the argument and its device: a call mixing meta and real tensors is
refused, as is a trace whose devices the real op would refuse. All-meta calls (meta tracing) and FakeTensor
tracing (FakeTensors report the devices they stand for) pass with consistent devices."""

import functools

import torch

# op -> (reference argument, host arguments (CPU on every device; meta too under meta tracing), list arguments
# (entries on the reference's device type: peers' replicas may sit on another index)). Every other tensor
# argument must be on the reference's device: the rules of python/csrc (make_dispatch_params, target_of,
# make_indexer_params, fence_cpu / fence_cuda, ...).
_DEVICE_RULES = {
    "dispatch": ("kv", ("targets_host", "row_dests_host"), ("written",)),
    "combine": ("mla_cache", (), ()),
    "insert": ("mla_cache", (), ()),
    "fence": ("epochs", ("error",), ("written",)),
    "quantize_index_q": ("q", (), ()),
    "quantize_index_q_aten": ("q", (), ()),
    "indexer_topk": ("q_fp8", (), ()),
    "sparse_mla": ("q", (), ()),
    "lse_merge": ("outs", (), ()),
}


def _why(dev: torch.device, other: torch.device) -> str:
    if "meta" in (dev.type, other.type):
        return " (a meta tensor among real ones ran the op's meta kernel, which computes and writes nothing)"
    return ""


@functools.lru_cache(maxsize=None)
def _arg_names(name: str) -> tuple:
    return tuple(a.name for a in getattr(torch.ops.pcpkv, name).default._schema.arguments)


def check_devices(name: str, args, kwargs) -> None:
    """ValueError naming the first tensor argument of op `name` on a device its _DEVICE_RULES refuse."""
    ref_name, host, lists = _DEVICE_RULES[name]
    names = _arg_names(name)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    ref = bound.get(ref_name)
    if not isinstance(ref, torch.Tensor):
        return  # the real op names the missing argument
    dev = ref.device
    for arg in names:
        value = bound.get(arg)
        if arg in lists:
            for i, t in enumerate(value or ()):
                if isinstance(t, torch.Tensor) and t.device.type != dev.type:
                    raise ValueError(f"{name}: {arg}[{i}] is on {t.device} but {ref_name} on {dev}: the tensors "
                                     f"{arg} declares must be on {dev.type}{_why(dev, t.device)}")
        elif isinstance(value, torch.Tensor):
            if arg in host:
                if value.device.type != "cpu" and not (value.device.type == "meta" and dev.type == "meta"):
                    raise ValueError(f"{name}: {arg} is on {value.device}: it is a host copy, which must be on the "
                                     f"CPU{_why(dev, value.device)}")
            elif value.device != dev:
                raise ValueError(f"{name}: {arg} is on {value.device} but {ref_name} on {dev}: every tensor "
                                 f"argument must be on {ref_name}'s device{_why(dev, value.device)}")


def _fake_of(name: str):
    def _fake(*args, **kwargs):
        check_devices(name, args, kwargs)
        return None

    return _fake


def _register():
    for name in _DEVICE_RULES:
        torch.library.register_fake(f"pcpkv::{name}")(_fake_of(name))


_register()
