"""Loads vLLM's DeepSeek-V3.2 ``fused_norm_rope`` for bench/vllm_peer.py: the installed vLLM package, else the kernel
file that scripts/fetch_vllm_kernel.py extracted from a vLLM wheel (no vLLM code is in this repository).

Without the package, kernels.py is executed from its own file with stand-in modules for exactly its imports, put in
sys.modules only while it executes:
  * vllm.platforms.current_platform: a CUDA platform answering from torch.cuda what kernels.py asks (fp8_dtype,
    is_cuda, is_device_capability_family, is_arch_support_pdl) by vLLM 0.34.0's rules (platforms/interface.py:
    e4m3fn, family = capability // 10; platforms/cuda.py: PDL where the major capability is >= 9);
  * vllm.triton_utils: the installed triton and triton.language;
  * vllm's helpers, compiled from their own files' text at run time (only the named definitions, so their
    modules' other imports are not needed): pack_ue8m0_x4 (v1/attention/ops/common.py), mqa_logits_use_mx_scales
    (utils/deep_gemm.py), KVQuantMode / get_kv_quant_mode / is_quantized_kv_cache (v1/kv_cache_interface.py;
    get_kv_quant_mode's lookup of plugin dtype handlers answers None: the handler registry of vllm.config.cache
    is empty unless a plugin registers one).
Compiling under the files' own names and line numbers keeps inspect.getsource (what @triton.jit reads) working.
"""
import ast
import functools
import hashlib
import importlib.util
import json
import os
import sys
import types
from enum import IntEnum

KERNEL_MODULE = "vllm.models.deepseek_v32.common.kernels"
KERNEL_FILE = "vllm/models/deepseek_v32/common/kernels.py"
HELPERS = {  # file -> the definitions compiled from it
    "vllm/v1/attention/ops/common.py": ("pack_ue8m0_x4",),
    "vllm/utils/deep_gemm.py": ("mqa_logits_use_mx_scales",),
    "vllm/v1/kv_cache_interface.py": ("KVQuantMode", "get_kv_quant_mode", "is_quantized_kv_cache"),
}


class Unavailable(Exception):
    """vLLM's kernel cannot be loaded this way; the message says why."""


class CudaPlatformStandIn:
    """What kernels.py asks vllm.platforms.current_platform, answered from torch.cuda as vLLM 0.34.0's CudaPlatform."""

    def __init__(self, torch):
        self._torch = torch

    def is_cuda(self) -> bool:
        return True

    def fp8_dtype(self):
        return self._torch.float8_e4m3fn  # Platform.fp8_dtype: OCP e4m3 (fnuz is ROCm's)

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        major, minor = self._torch.cuda.get_device_capability(device_id)
        return (major * 10 + minor) // 10 == capability // 10

    def is_arch_support_pdl(self) -> bool:
        try:  # CudaPlatformBase.is_arch_support_pdl: the current device's major capability >= 9 (sm_90 and later)
            major, _ = self._torch.cuda.get_device_capability(self._torch.cuda.current_device())
        except Exception:
            return False
        return major >= 9


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []  # a package, so that its children resolve
    m.__dict__.update(attrs)
    return m


def compile_definitions(path: str, names, module_name: str, namespace: dict) -> types.ModuleType:
    """A module holding only the top-level definitions `names` of the file at `path` (and its __future__
    imports), compiled under that file's name and line numbers, their globals being `namespace`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    body = [n for n in tree.body if (isinstance(n, ast.ImportFrom) and n.module == "__future__")
            or (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names)]
    missing = set(names) - {n.name for n in body if not isinstance(n, ast.ImportFrom)}
    if missing:
        raise Unavailable(f"{path} has no top-level {sorted(missing)} (a vLLM version this loader does not know)")
    mod = _module(module_name, __file__=path, **namespace)
    try:
        exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), mod.__dict__)
    except Exception as e:  # a name this loader does not provide (a vLLM version it does not know)
        raise Unavailable(f"compiling {sorted(names)} from {path} failed: {type(e).__name__}: {e}") from e
    return mod


def _check_manifest(kernel_dir: str) -> dict:
    manifest_path = os.path.join(kernel_dir, "MANIFEST.json")
    if not os.path.isfile(manifest_path):
        raise Unavailable(f"no {manifest_path}: run scripts/fetch_vllm_kernel.py (it extracts vLLM's kernel file "
                          "from a vLLM wheel) and carry that folder")
    with open(manifest_path) as f:
        manifest = json.load(f)
    for name in (KERNEL_FILE, *HELPERS):
        path = os.path.join(kernel_dir, name)
        if not os.path.isfile(path):
            raise Unavailable(f"{path} is missing (re-run scripts/fetch_vllm_kernel.py)")
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if manifest.get("files", {}).get(name) != digest:
            raise Unavailable(f"{path}: sha256 {digest} is not MANIFEST.json's {manifest.get('files', {}).get(name)} "
                              "(edited after extraction? re-run scripts/fetch_vllm_kernel.py)")
    return manifest


def load_from_dir(kernel_dir: str):
    """(kernels module, description) from the files scripts/fetch_vllm_kernel.py extracted."""
    manifest = _check_manifest(kernel_dir)
    try:
        import torch
        import triton
        import triton.language as tl
    except ImportError as e:
        raise Unavailable(f"vLLM's kernel is Triton; {e}") from e
    platform = CudaPlatformStandIn(torch)
    p = lambda name: os.path.join(kernel_dir, name)  # noqa: E731
    config_cache = _module("vllm.config.cache", get_kv_cache_dtype_handler=lambda name: None)
    stand_ins = {
        "vllm": _module("vllm", __version__=manifest.get("version", "?")),
        "vllm.platforms": _module("vllm.platforms", current_platform=platform),
        "vllm.triton_utils": _module("vllm.triton_utils", triton=triton, tl=tl),
        "vllm.utils": _module("vllm.utils"),
        "vllm.utils.deep_gemm": compile_definitions(p("vllm/utils/deep_gemm.py"), HELPERS["vllm/utils/deep_gemm.py"],
                                                    "vllm.utils.deep_gemm",
                                                    {"current_platform": platform, "functools": functools}),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.attention": _module("vllm.v1.attention"),
        "vllm.v1.attention.ops": _module("vllm.v1.attention.ops"),
        "vllm.v1.attention.ops.common": compile_definitions(
            p("vllm/v1/attention/ops/common.py"), HELPERS["vllm/v1/attention/ops/common.py"],
            "vllm.v1.attention.ops.common", {"triton": triton, "tl": tl}),
        "vllm.v1.kv_cache_interface": compile_definitions(
            p("vllm/v1/kv_cache_interface.py"), HELPERS["vllm/v1/kv_cache_interface.py"],
            "vllm.v1.kv_cache_interface",
            # get_kv_quant_mode imports vllm.config.cache when called: its builtins answer that import, so no fake
            # vllm stays in sys.modules after loading
            {"IntEnum": IntEnum, "__builtins__": _builtins_importing({"vllm.config.cache": config_cache})}),
        "vllm.models": _module("vllm.models"),
        "vllm.models.deepseek_v32": _module("vllm.models.deepseek_v32"),
        "vllm.models.deepseek_v32.common": _module("vllm.models.deepseek_v32.common"),
    }
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location(KERNEL_MODULE, p(KERNEL_FILE))
        kernels = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kernels)
    except Exception as e:
        raise Unavailable(f"executing {p(KERNEL_FILE)} with stand-ins failed: {type(e).__name__}: {e}") from e
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    how = (f"kernel file from wheel {manifest.get('wheel')} (vLLM {manifest.get('version')}, sha256 "
           f"{manifest.get('wheel_sha256')}) in {kernel_dir}, with stand-ins for vllm.platforms / vllm.triton_utils "
           "and vLLM's helpers compiled from their files")
    return kernels, how


def _builtins_importing(modules: dict) -> dict:
    """builtins whose __import__ answers `modules` first (the function-level imports of compiled helpers)."""
    import builtins
    real_import = builtins.__import__

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A001
        if level == 0 and name in modules and fromlist:  # `from NAME import x` only
            return modules[name]
        return real_import(name, globals, locals, fromlist, level)
    b = dict(builtins.__dict__)
    b["__import__"] = __import__
    return b


def load(kernel_dir: str):
    """(fused_norm_rope, kernels module, how it was loaded); raises Unavailable saying why neither way works."""
    try:
        import vllm
        kernels = importlib.import_module(KERNEL_MODULE)
        return kernels.fused_norm_rope, kernels, f"installed vLLM {vllm.__version__} ({kernels.__file__})"
    except Exception as e:  # no vLLM, or one without the module: try the extracted file
        installed = f"{type(e).__name__}: {e}"
    try:
        kernels, how = load_from_dir(kernel_dir)
    except Unavailable as e:
        raise Unavailable(f"vLLM is not importable ({installed}) and {e}") from e
    if not hasattr(kernels, "fused_norm_rope"):
        raise Unavailable(f"vLLM is not importable ({installed}) and {kernel_dir}'s {KERNEL_FILE} has no "
                          "fused_norm_rope")
    return kernels.fused_norm_rope, kernels, how
