"""scripts/plot_bench.py: a PNG from a small synthetic `pcpkv bench --json` file (skips without matplotlib),
malformed files refused naming the field, and exit 2 with the install hint when matplotlib is missing."""

import copy
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "plot_bench.py")


def run(path, *extra, env=None):
    return subprocess.run([sys.executable, SCRIPT, str(path), *extra], capture_output=True, text=True, env=env,
                          timeout=120)


def stage(name, ms, mb):
    return {"name": name, "ms": ms, "bytes": int(mb * 1e6), "gbps": mb / ms, "fraction_of_copy": 0.5}


def bench_doc():
    """The shape cmd_bench.cpp writes (numbers of the order of docs/results/2026-12-01-h200)."""
    runs = []
    for model in ("glm-5", "deepseek-v3.2"):
        for transport, variant, stages, floor in (
                ("collect", "prefetch:separate:1", [("topk-fill", 0.068, 268), ("dispatch", 0.147, 361),
                                                    ("all-gather", 0.151, 738), ("insert", 0.197, 576)], 0.455),
                ("staging", "warp:fused:4", [("dispatch", 0.268, 793), ("fence", 0.005, 0), ("combine", 0.125, 416)],
                 0.283),
                ("direct", "warp:fused:4", [("dispatch", 0.268, 790), ("fence", 0.005, 0)], 0.185)):
            total = sum(s[1] for s in stages)
            runs.append({"model": model, "pcp": 8, "kv_format": "fp8_ds_mla", "layer": "indexer", "tokens": 32768,
                         "transport": transport, "variant": variant, "stages": [stage(*s) for s in stages],
                         "total_ms": total, "bytes": 10 ** 9, "gbps": 3000.0, "fraction_of_copy": 0.7,
                         "floor_ms": floor, "time_over_floor": total / floor, "graph_ms": None,
                         **({} if transport == "collect" else {"speedup_vs_collect": 0.563 / total})})
    singles = [{"model": "glm-5", "kv_format": "fp8_ds_mla", "tokens": t, "variant": "warp", "fused_topk": f,
                "ms": ms, "bytes": 7.6e7, "gbps": 2000.0, "fraction_of_copy": 0.5, "floor_ms": fl,
                "time_over_floor": ms / fl, "vllm_time_over_floor": None}
               for t, f, ms, fl in ((4096, True, 0.034, 0.0182), (32768, False, 0.175, 0.1454))]
    return {"command": "pcpkv bench ...", "device": {"name": "NVIDIA H200", "num_sms": 132, "l2_bytes": 62914560},
            "copy_bandwidth_gbps": 4192.0, "copy_bytes": 2 << 30, "kernels": [], "single_rank": singles,
            "runs": runs}


def write(tmp_path, doc, name="bench.json"):
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def test_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/requirements-plot.txt)")
    p = write(tmp_path, bench_doc())
    r = run(p)
    assert r.returncode == 0, r.stderr
    png = tmp_path / "bench.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, f"{png}: {len(data)} bytes"
    assert "6 runs, 2 single-rank cases" in r.stdout
    out = tmp_path / "only_runs.png"
    doc = bench_doc()
    del doc["single_rank"]
    assert run(write(tmp_path, doc, "r.json"), "-o", str(out), "--title", "t").returncode == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def broken(path, value):
    """bench_doc() with the field at `path` (a list of keys / indices) set to value (or deleted: ...)."""
    doc = copy.deepcopy(bench_doc())
    obj = doc
    for k in path[:-1]:
        obj = obj[k]
    if value is ...:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return doc


@pytest.mark.parametrize("doc, field", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "the document: expected a JSON object"),
    ({"runs": []}, "runs: missing or empty"),
    (broken(["runs", 2, "stages", 1, "ms"], "x"), "runs[2].stages[1].ms = 'x'"),
    (broken(["runs", 0, "stages", 0, "name"], ...), "runs[0].stages[0].name: missing"),
    (broken(["runs", 3, "floor_ms"], -1.0), "runs[3].floor_ms = -1.0: must be >= 0"),
    (broken(["runs", 1, "total_ms"], ...), "runs[1].total_ms: missing"),
    (broken(["runs", 4, "stages"], []), "runs[4].stages: empty"),
    (broken(["runs", 5, "transport"], 3), "runs[5].transport = 3"),
    (broken(["runs", 0, "pcp"], 0), "runs[0].pcp = 0: must be >= 1"),
    (broken(["single_rank", 1, "tokens"], "4096"), "single_rank[1].tokens = '4096'"),
    (broken(["runs"], {"a": 1}), "runs = {'a': 1}: expected a list"),
])
def test_bad_json_names_the_field(tmp_path, doc, field):
    r = run(write(tmp_path, doc))
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert field in r.stderr, r.stderr
    assert not (tmp_path / "bench.png").exists()


def test_missing_file_and_missing_matplotlib(tmp_path):
    r = run(tmp_path / "nope.json")
    assert r.returncode == 1 and "cannot read" in r.stderr
    # A matplotlib that fails to import stands in for none installed.
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = run(write(tmp_path, bench_doc()), env=env)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "requirements-plot.txt" in r.stderr and "pip install" in r.stderr
    assert not (tmp_path / "bench.png").exists()


RESULTS_MD = os.path.join(os.path.dirname(SCRIPT), "..", "docs", "results", "2026-12-01-h200",
                          "overflow_guard_bench_after_1.md")


def read_markdown(text):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        from bench_markdown import read_markdown as rm
    finally:
        sys.path.pop(0)
    return rm(text)


def test_reads_a_saved_bench_markdown():
    """A real run's --markdown output (docs/results) read back into the JSON fields, values as in its tables."""
    with open(RESULTS_MD, encoding="utf-8") as f:
        doc = read_markdown(f.read())
    assert doc["copy_bandwidth_gbps"] == 4192.0 and doc["device"]["name"] == "NVIDIA H200"
    runs = {(r["model"], r["transport"]): r for r in doc["runs"]}
    assert len(doc["runs"]) == 6 and len(runs) == 6
    d = runs[("glm-5", "direct")]
    assert (d["total_ms"], d["floor_ms"], d["time_over_floor"], d["speedup_vs_collect"]) == (0.273, 0.188, 1.45, 2.07)
    assert [(s["name"], s["ms"]) for s in d["stages"]] == [("dispatch", 0.268), ("fence", 0.0053)]
    assert [s["name"] for s in runs[("deepseek-v3.2", "collect")]["stages"]] == [
        "topk-fill", "dispatch", "all-gather", "insert-mla", "insert-indexer"]
    assert "speedup_vs_collect" not in runs[("glm-5", "collect")] and d["tokens"] == 32768
    s = doc["single_rank"][2]
    assert (s["model"], s["tokens"], s["fused_topk"]) == ("glm-5", 32768, True)
    assert (s["ms"], s["floor_ms"]) == pytest.approx((0.1847, 0.1454), rel=1e-12)  # us in the table


def test_reads_the_single_rank_graph_column():
    """Tables since 2026-12-03 carry a 'graph us' column (graph replays); '-' (not measured) and older tables
    without it give no graph_ms."""
    with open(RESULTS_MD, encoding="utf-8") as f:
        text = f.read()
    assert all("graph_ms" not in s for s in read_markdown(text)["single_rank"])
    text = text.replace("| tokens | variant | top-k fill | time us |", "| tokens | variant | top-k fill | time us | graph us |")
    text = text.replace("|---|---|---|---|---|---|---|---|\n| 4096", "|---|---|---|---|---|---|---|---|---|\n| 4096")
    text = text.replace("| 4096 | warp | fused | 34.0 |", "| 4096 | warp | fused | 34.0 | 21.5 |")
    text = text.replace("| 4096 | warp | separate | 36.5 |", "| 4096 | warp | separate | 36.5 | - |")
    text = text.replace("| 32768 | warp | fused | 184.7 |", "| 32768 | warp | fused | 184.7 | 170.0 |")
    text = text.replace("| 32768 | warp | separate | 175.2 |", "| 32768 | warp | separate | 175.2 | 168.2 |")
    singles = read_markdown(text)["single_rank"]
    assert "graph_ms" not in singles[1]
    assert [singles[i]["graph_ms"] for i in (0, 2, 3)] == pytest.approx([0.0215, 0.170, 0.1682], rel=1e-12)
    assert singles[0]["floor_ms"] == pytest.approx(0.0182, rel=1e-12)  # the columns after it still line up


def test_plots_a_saved_bench_markdown(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/requirements-plot.txt)")
    out = tmp_path / "md.png"
    r = run(RESULTS_MD, "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:4] == b"\x89PNG" and "6 runs, 4 single-rank cases" in r.stdout


@pytest.mark.parametrize("edit, field", [
    (lambda t: t.replace("## summary", "## totals"), "no '## summary...' table"),
    (lambda t: t.replace("| 0.273 | 0.257 |", "| fast | 0.257 |"), "summary row 3: column 'layer ms' = 'fast'"),
    (lambda t: t.replace("| direct | warp:fused:4 | dispatch |", "| direkt | warp:fused:4 | dispatch |", 1),
     "stages row 9: no summary row"),
])
def test_bad_markdown_names_the_table(tmp_path, edit, field):
    with open(RESULTS_MD, encoding="utf-8") as f:
        text = edit(f.read())
    p = tmp_path / "bench.md"
    p.write_text(text)
    r = run(p)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert field in r.stderr, r.stderr


RESULTS_MD_TAIL = os.path.join(os.path.dirname(SCRIPT), "..", "docs", "results", "2026-12-02e-h200",
                               "dispatch_cs_ab", "m_tail_1.md")


def test_reads_a_tail_fill_markdown_with_replica_check_rows():
    """A run of 2026-12-02 (--topk-fill tail): its replica-check stage rows, counted in no transport total, are
    not a transport's stages, and a single-rank fill column of "fused, tail" is a fused fill."""
    with open(RESULTS_MD_TAIL, encoding="utf-8") as f:
        text = f.read()
    assert "| replica-check |" in text and "| fused, tail |" in text  # what this test is about
    doc = read_markdown(text)
    runs = {(r["model"], r["transport"]): r for r in doc["runs"]}
    assert len(doc["runs"]) == 6 and len(runs) == 6
    assert [s["name"] for s in runs[("glm-5", "direct")]["stages"]] == ["dispatch", "fence"]
    assert all(s["name"] != "replica-check" for r in doc["runs"] for s in r["stages"])
    assert [(s["tokens"], s["fused_topk"]) for s in doc["single_rank"]] == [
        (4096, True), (4096, False), (32768, True), (32768, False)]
