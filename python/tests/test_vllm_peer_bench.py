"""bench/vllm_peer.py and its helpers (no vLLM code in this repository): scripts/fetch_vllm_kernel.py extracts the
named files from a wheel with their sha256; the loader refuses, saying why, without a kernel folder or with an
edited file, and (where build/vllm-kernel and triton exist) loads vLLM's kernel leaving no fake vllm in sys.modules;
the byte comparison counts one-code and beyond-one-code differences per region; the pcpkv side's call runs on CPU."""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from helpers import pk, torch

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
KERNEL_DIR = os.path.join(REPO, "build", "vllm-kernel")
sys.path.insert(0, os.path.join(REPO, "bench"))
import vllm_kernel_loader as loader  # noqa: E402
import vllm_peer  # noqa: E402

FETCH = os.path.join(REPO, "scripts", "fetch_vllm_kernel.py")
FILES = ("vllm/models/deepseek_v32/common/kernels.py", "vllm/v1/attention/ops/common.py", "vllm/utils/deep_gemm.py",
         "vllm/v1/kv_cache_interface.py")
requires_kernel_dir = pytest.mark.skipif(not os.path.isfile(os.path.join(KERNEL_DIR, "MANIFEST.json")),
                                         reason="no build/vllm-kernel (run scripts/fetch_vllm_kernel.py)")


def fake_wheel(path, files=FILES, version="9.9.9"):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"vllm-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        for i, name in enumerate(files):
            z.writestr(name, f"# file {i}\n")
    return path


def test_fetch_extracts_the_files_with_their_sha256(tmp_path):
    wheel = fake_wheel(tmp_path / "vllm-9.9.9-py3-none-any.whl")
    out = tmp_path / "kernel"
    r = subprocess.run([sys.executable, FETCH, "--wheel", str(wheel), "--out", str(out)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["version"] == "9.9.9"
    assert manifest["wheel_sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert sorted(manifest["files"]) == sorted(FILES)
    for i, name in enumerate(FILES):
        assert (out / name).read_text() == f"# file {i}\n"
        assert manifest["files"][name] == hashlib.sha256((out / name).read_bytes()).hexdigest()


def test_fetch_refuses_a_wheel_without_the_kernel(tmp_path):
    wheel = fake_wheel(tmp_path / "vllm-0.1.0-py3-none-any.whl", files=FILES[1:], version="0.1.0")
    r = subprocess.run([sys.executable, FETCH, "--wheel", str(wheel), "--out", str(tmp_path / "k")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "vLLM 0.1.0" in r.stderr and "kernels.py" in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: the loader uses it")
def test_loader_says_why_without_a_kernel_dir(tmp_path):
    with pytest.raises(loader.Unavailable, match=r"vLLM is not importable .*MANIFEST.json.*fetch_vllm_kernel"):
        loader.load(str(tmp_path / "none"))


@requires_kernel_dir
def test_loader_refuses_an_edited_file(tmp_path):
    d = tmp_path / "k"
    shutil.copytree(KERNEL_DIR, d)
    with open(d / FILES[0], "a") as f:
        f.write("\n# edited\n")
    with pytest.raises(loader.Unavailable, match="sha256"):
        loader.load_from_dir(str(d))


@requires_kernel_dir
def test_loader_loads_the_kernel_with_stand_ins():
    pytest.importorskip("triton", reason="triton is not installed (vLLM's kernel is Triton)")
    before = {m for m in sys.modules if m == "vllm" or m.startswith("vllm.")}
    kernels, how = loader.load_from_dir(KERNEL_DIR)
    assert {m for m in sys.modules if m == "vllm" or m.startswith("vllm.")} == before  # stand-ins removed
    assert "stand-ins" in how and json.load(open(os.path.join(KERNEL_DIR, "MANIFEST.json")))["wheel_sha256"] in how
    assert kernels._FP8_DTYPE == torch.float8_e4m3fn and kernels._FP8_MAX == 448.0
    # vLLM's own helpers, compiled from its files: fp8_ds_mla is a quantized dtype, "auto" is not
    assert kernels.is_quantized_kv_cache("fp8_ds_mla") and not kernels.is_quantized_kv_cache("auto")
    args = {k: None for k in ("positions", "q_c", "q_rms_norm_w", "q_rms_eps", "kv_c", "kv_rms_norm_w", "kv_rms_eps",
                              "k_pe", "k_rope_cos_sin_cache", "index_k", "index_k_layer_norm_w",
                              "index_k_layer_norm_bias", "index_k_layer_norm_eps", "index_k_rope_cos_sin_cache",
                              "topk_indices_buffer", "slot_mapping", "indexer_k_cache", "mla_kv_cache",
                              "mla_kv_cache_dtype", "mla_k_scale", "has_indexer", "index_rope_interleave", "q_c_out",
                              "kv_c_out", "k_pe_out")}
    kw = vllm_peer.vllm_kwargs(kernels.fused_norm_rope, args)
    if "indexer_cache_shuffled" in kw:  # vLLM 0.34.0: its CUDA indexer cache is unshuffled, and writes pow2 scales
        assert kw["indexer_cache_shuffled"] is False
        assert vllm_peer.ds_mla_rule(kernels) == "pow2"


def regions(seed=0):
    g = torch.Generator().manual_seed(seed)
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
    v = {"mla_kv_cache": u8(2, vllm_peer.BLOCK_SIZE, 656), "indexer_k_cache": u8(2, vllm_peer.BLOCK_SIZE, 132),
         "q_c_out": torch.randn(8, 64, generator=g).to(torch.bfloat16),
         "topk_indices_buffer": torch.randint(-1, 100, (8, 16), generator=g, dtype=torch.int32)}
    return v, {k: t.clone() for k, t in v.items()}


def test_compare_counts_one_step_and_beyond():
    v, p = regions()
    assert all(d == (0, 0) for d in vllm_peer.compare(torch, v, p).values())
    m = p["mla_kv_cache"]
    m[0, 0, 0] = (int(v["mla_kv_cache"][0, 0, 0]) & 0x80) | ((int(v["mla_kv_cache"][0, 0, 0]) & 0x7F) ^ 1)  # 1 code
    m[0, 1, 5] = int(v["mla_kv_cache"][0, 1, 5]) ^ 0x80  # the sign: beyond one step
    m[1, 2, 7] = (int(v["mla_kv_cache"][1, 2, 7]) & 0x80) | ((int(v["mla_kv_cache"][1, 2, 7]) & 0x7F) ^ 2)  # 2 codes
    v["mla_kv_cache"][1, 5, 9], m[1, 5, 9] = 0x7F, 0x80  # codes one apart but of two signs: beyond
    m[0, 3, 513] ^= 0x01  # one byte of one fp32 tile scale
    kpe = m[1, 4, 528:].view(torch.int16)
    kpe[3] = int(kpe[3]) ^ 1  # one bf16 ulp
    p["indexer_k_cache"].flatten(1)[1, vllm_peer.BLOCK_SIZE * 128 + 9] ^= 0x40  # one indexer scale byte
    p["topk_indices_buffer"][2, 3] += 1
    d = vllm_peer.compare(torch, v, p)
    assert d["mla kv_c e4m3"] == (4, 3)
    assert d["mla tile scales"] == (1, 1)
    assert d["mla k_pe"] == (1, 0)
    assert d["indexer e4m3"] == (0, 0) and d["indexer scales"] == (1, 1)
    assert d["q_c_out"] == (0, 0) and d["top-k rows"] == (1, 1)


@pytest.mark.parametrize("model", ["glm-5", "deepseek-v3.2"])
def test_pcpkv_side_runs_the_compared_work_on_cpu(model):
    """The bench's pcpkv call (CPU reference here): q_c_out, both caches at every valid slot, all top-k rows."""
    spec = pk.ModelSpec.from_hf_config(json.load(open(os.path.join(REPO, "configs", f"{model}.json"))))
    a = vllm_peer.inputs(torch, pk, spec, 40, seed=3, kv_out=True, device="cpu")
    p = vllm_peer.outputs_copy(a)
    vllm_peer.pcpkv_call(torch, pk, p, "pow2")()
    assert (p["topk_indices_buffer"] == -1).all()
    assert not (p["q_c_out"] == 7).any() and not (p["kv_c_out"] == 7).any() and not (p["k_pe_out"] == 7).any()
    slots = a["slot_mapping"]
    rows = p["mla_kv_cache"].flatten(0, 1)
    written = (rows != a["mla_kv_cache"].flatten(0, 1)).any(dim=1)
    assert written.nonzero().flatten().tolist() == sorted(slots[slots >= 0].tolist())
    # the tile scales are powers of two (the pow2 rule the bench passes for vLLM 0.34.0)
    scales = rows[slots[slots >= 0]][:, 512:528].contiguous().view(torch.float32)
    assert (torch.frexp(scales).mantissa == 0.5).all()
