"""Builds pcpkv_torch._C against the installed torch, from pcpkv's sources (no download, no CMake build).

    pip install --no-build-isolation ./python               # into the environment
    pip wheel --no-build-isolation ./python                 # a wheel (for this torch, Python and platform)
    cd python && python setup.py build_ext --inplace        # in-tree (tests, development)

The project's metadata (name, version, requirements, extras, the packages: every package under pcpkv_torch/)
is in pyproject.toml; this file adds the extension. It needs the installed torch, so pip's default isolated
build (which hides it) stops with a message saying to add --no-build-isolation.

Environment:
    PCPKV_TORCH_CUDA=0|1      build the CUDA ops (default: 1 when torch has CUDA and nvcc is found)
    TORCH_CUDA_ARCH_LIST      CUDA architectures (default "9.0": H100/H200)
    MAX_JOBS                  parallel compile jobs (ninja)

The extension compiles pcpkv's core sources it needs (layouts, RoPE tables, PCP plan, the CPU reference
kernels) and, with CUDA, pcpkv's own launchers and kernels (pcpkv/publish/kernels.h: dispatch*.cu, combine.cu,
insert.cu, fence.cu, plus device.cpp and pdl_switch.cpp; the consumers' indexer_kernels.cu,
sparse_mla_*.cu, lse_merge_kernels.cu): the torch ops run exactly the kernels the C++ library runs. fmt comes header-only from torch's own include directory, so nothing beyond torch, a C++20 compiler
and (for CUDA) nvcc is needed.
"""

import glob
import os
import sys

import setuptools

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _sources():
    src = os.path.join(ROOT, "src")
    core = [os.path.join(src, "core", f"{n}.cpp") for n in ("layout", "rope", "plan", "env", "byte_range")]
    # transport "auto" (choose_transport and the transport names it returns)
    core += [os.path.join(src, "publish", f) for f in ("drivers/transport_choice.cpp", "contract/transport_names.cpp")]
    cpu = [os.path.join(src, "publish", "kernels", "cpu", f"{n}.cpp") for n in ("dispatch", "combine")]
    cpu += [os.path.join(src, "publish", "contract", "validate_params.cpp")]
    cpu += [os.path.join(src, "consumers", "kernels", "cpu", f"{n}.cpp")
            for n in ("indexer_reference", "sparse_mla_reference", "lse_merge_reference")]
    # The ops (csrc/registry.cpp: every schema; one file per op, whose CUDA half compiles with PCPKV_TORCH_CUDA).
    own = sorted(glob.glob(os.path.join(HERE, "csrc", "*.cpp")))
    # pcpkv's rendezvous and host symmetric memory (pcpkv_torch.distributed: csrc/bootstrap.cpp, symmetric.cpp)
    ranks = [os.path.join(src, f) for f in ("core/input_limits.cpp", "core/interrupt.cpp", "ranks/bootstrap.cpp",
                                            "ranks/bootstrap_rendezvous.cpp", "ranks/bootstrap_star.cpp",
                                            "ranks/bootstrap_socket.cpp", "ranks/bootstrap_wire.cpp",
                                            "ranks/tombstone.cpp",
                                            "ranks/symmetric_shm.cpp", "ranks/fd_limit.cpp")]
    return core + cpu + ranks + own


# pcpkv's CUDA sources behind the launchers of pcpkv/publish/kernels.h that the ops call (launch_dispatch,
# launch_combine, launch_insert_mla / launch_insert_indexer, launch_fence) and what they need (num_sms in
# device.cpp; the dispatch kernel variants in dispatch*.cu; the PDL switch; read_env of core/env.cpp, in the
# core list above). run_device_tests.sh refuses a build with an undefined pcpkv symbol, which is what a
# source missing here looks like.
# The consumer ops (csrc/indexer_topk.cpp, sparse_mla.cpp, lse_merge.cpp) call cuda::indexer, cuda::sparse_mla and cuda::lse_merge.
CUDA_SOURCES = ("publish/kernels/cuda/combine.cu", "publish/kernels/cuda/insert.cu", "publish/kernels/cuda/fence.cu",
                "core/cuda/device.cpp",
                "consumers/kernels/cuda/indexer_kernels.cu", "consumers/kernels/cuda/sparse_mla_kernels.cu",
                "consumers/kernels/cuda/sparse_mla_mma.cu", "consumers/kernels/cuda/lse_merge_kernels.cu")
# Device symmetric memory of pcpkv_torch.distributed (csrc/symmetric.cpp): ranks/cuda/symmetric_vmm.cpp.
CUDA_SOURCES += ("ranks/cuda/symmetric_vmm.cpp",)
# dispatch*.cu's CUDA-free half: the variant names and the PCPKV_DISPATCH_VARIANT rule (dispatch_variant.h).
CUDA_SOURCES += ("publish/contract/dispatch_variant.cpp",)
CUDA_SOURCES_IF_PRESENT = ("core/cuda/pdl_switch.cpp",)


def _cuda_sources():
    d = os.path.join(ROOT, "src")
    dispatch = ("publish/kernels/cuda/dispatch.cu",)
    missing = [f for f in CUDA_SOURCES + dispatch if not os.path.exists(os.path.join(d, f))]
    if missing:
        raise RuntimeError(f"pcpkv_torch: src/{missing} not found (set PCPKV_TORCH_CUDA=0 for a CPU-only build)")
    kernels = os.path.join(d, "publish", "kernels", "cuda")
    names = sorted(os.path.relpath(p, d) for p in glob.glob(os.path.join(kernels, "dispatch*.cu")))
    names += list(CUDA_SOURCES) + [f for f in CUDA_SOURCES_IF_PRESENT if os.path.exists(os.path.join(d, f))]
    return [os.path.join(d, f) for f in names]


def _want_cuda():
    flag = os.environ.get("PCPKV_TORCH_CUDA")
    if flag is not None:
        return flag == "1"
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


def _extensions():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    cxx = ["-O2", "-std=c++20", "-ffp-contract=off", "-DFMT_HEADER_ONLY=1", "-Wno-unused-parameter",
           "-Wno-unknown-pragmas"]
    include_dirs = [os.path.join(ROOT, "include"), os.path.join(ROOT, "src"), os.path.join(HERE, "csrc")]
    sources = _sources()
    if not _want_cuda():
        return [CppExtension("pcpkv_torch._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx})]
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    sources += _cuda_sources()
    defines = ["-DPCPKV_TORCH_CUDA=1"]
    nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-Xcompiler=-ffp-contract=off", "-DFMT_HEADER_ONLY=1",
            "-lineinfo", "-diag-suppress=20208"] + defines
    return [
        CUDAExtension(
            "pcpkv_torch._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx + defines, "nvcc": nvcc},
        )
    ]


def _require_build_environment():
    """torch and a setuptools that can make a wheel, from the environment itself; else one clear message."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        isolated = any("pip-build-env" in p for p in sys.path)
        raise SystemExit(
            "pcpkv_torch: torch is not importable by the build"
            + (" (pip's build isolation hides the installed torch)" if isolated else "")
            + f": {e}. The extension is built against the torch it will run with: install torch first, then "
            "`pip install --no-build-isolation ./python` (or `pip wheel --no-build-isolation ./python`).") from e
    version = tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit())
    # dist_info: pip's metadata step, which needs bdist_wheel too
    wheel_cmds = {"bdist_wheel", "editable_wheel", "dist_info"}.intersection(sys.argv)
    if version < (61, 0) or (wheel_cmds and version < (70, 1) and _missing("wheel")):
        raise SystemExit(
            f"pcpkv_torch: setuptools {setuptools.__version__} of this environment cannot build it "
            f"({'no pyproject.toml metadata' if version < (61, 0) else 'no bdist_wheel without the wheel package'}): "
            "`pip install 'setuptools>=70.1,<82'` (pyproject.toml's build-system.requires) and build again.")


def _missing(module):
    import importlib.util

    return importlib.util.find_spec(module) is None


def main():
    # pyproject.toml and the package folders are found relative to the working directory.
    os.chdir(HERE)
    _require_build_environment()
    from torch.utils.cpp_extension import BuildExtension

    setuptools.setup(
        ext_modules=_extensions(),
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":
    main()
