"""Builds pcpkv_torch._C against the installed torch, from pcpkv's sources (no download, no CMake build).

    cd python && python setup.py build_ext --inplace        # in-tree (tests, development)
    pip install --no-build-isolation ./python               # into the environment

Environment:
    PCPKV_TORCH_CUDA=0|1      build the CUDA ops (default: 1 when torch has CUDA and nvcc is found)
    TORCH_CUDA_ARCH_LIST      CUDA architectures (default "9.0": H100/H200)
    MAX_JOBS                  parallel compile jobs (ninja)

The extension compiles pcpkv's core sources it needs (layouts, RoPE tables, PCP plan, the CPU reference
kernels) and, with CUDA, pcpkv's dispatch kernel (src/cuda/dispatch.cu) plus this package's kernels
(python/csrc/kernels.cu: combine, insert, fence launch, reference dispatch). fmt comes header-only from
torch's own include directory, so nothing beyond torch, a C++20 compiler and (for CUDA) nvcc is needed.
"""

import glob
import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _sources():
    core = [os.path.join(ROOT, "src", "core", f"{n}.cpp") for n in ("layout", "rope", "plan")]
    cpu = [os.path.join(ROOT, "src", "cpu", f"{n}.cpp") for n in ("dispatch", "combine", "validate_params")]
    own = sorted(glob.glob(os.path.join(HERE, "csrc", "*.cpp")))
    return core + cpu + [s for s in own if not s.endswith("_cuda.cpp")]


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
    sources += sorted(glob.glob(os.path.join(HERE, "csrc", "*_cuda.cpp")))
    sources += sorted(glob.glob(os.path.join(HERE, "csrc", "*.cu")))
    defines = ["-DPCPKV_TORCH_CUDA=1"]
    fast_dispatch = os.path.join(ROOT, "src", "cuda", "dispatch.cu")
    if os.path.exists(fast_dispatch):
        # pcpkv's fused dispatch kernel (issue 3); without it the reference kernel of csrc/kernels.cu runs.
        sources.append(fast_dispatch)
        defines.append("-DPCPKV_TORCH_FAST_DISPATCH=1")
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


def main():
    from torch.utils.cpp_extension import BuildExtension

    setup(
        name="pcpkv_torch",
        version="0.1.0",
        description="PyTorch custom ops for pcpkv: PCP KV-cache publication for DeepSeek-V3.2 / GLM-5",
        packages=["pcpkv_torch"],
        package_dir={"pcpkv_torch": os.path.join(HERE, "pcpkv_torch")} if os.getcwd() != HERE else {},
        ext_modules=_extensions(),
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        python_requires=">=3.10",
    )


if __name__ == "__main__":
    main()
