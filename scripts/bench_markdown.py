"""Reads the tables of `pcpkv bench --markdown FILE` (or its printed output) back into the shape of its
`--json` (the fields scripts/plot_bench.py draws), for runs saved before JSON was kept (docs/results/).

Used tables (tools/pcpkv/cmd_bench.cpp writes them): "## stages" (per stage ms and MB), "## summary: ...,
N tokens, L layer" (layer ms, floor ms, time/floor, speedup vs collect per run) and, when present, "## dispatch
alone, one rank (MODEL, KV, ...)" (single-rank cases). Raises ValueError naming the table, row and column of a
missing or malformed entry.
"""

from __future__ import annotations

import re


def _tables(text: str) -> dict:
    """heading (the '## ' line without the marks) -> list of rows, each a dict column -> cell text."""
    out, heading, header = {}, None, None
    for line in text.splitlines():
        if line.startswith("## "):
            heading, header = line[3:].strip(), None
            out[heading] = []
            continue
        if heading is None or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(set(c) <= set("-:") for c in cells):
            out[heading].append(dict(zip(header, cells)))
    return out


def _find(tables: dict, prefix: str, required: bool = True):
    for h, rows in tables.items():
        if h.startswith(prefix):
            return h, rows
    if required:
        raise ValueError(f"markdown: no '## {prefix}...' table (is this `pcpkv bench --markdown` output?)")
    return None, []


def _num(row: dict, col: str, where: str, *, suffix: str = "") -> float:
    v = row.get(col)
    if v is None:
        raise ValueError(f"{where}: column '{col}' missing")
    try:
        return float(v[:-len(suffix)] if suffix and v.endswith(suffix) else v)
    except ValueError:
        raise ValueError(f"{where}: column '{col}' = {v!r} is not a number") from None


def read_markdown(text: str) -> dict:
    """The bench JSON's fields (device, copy_bandwidth_gbps, runs, single_rank) from the markdown tables."""
    doc = {}
    m = re.search(r"^device: (.+?) \(", text, re.M)
    if m:
        doc["device"] = {"name": m.group(1)}
    m = re.search(r"copy bandwidth (\d+(?:\.\d+)?) GB/s", text)
    if m:
        doc["copy_bandwidth_gbps"] = float(m.group(1))
    tables = _tables(text)
    heading, summary = _find(tables, "summary")
    m = re.search(r"(\d+) tokens, (\w+) layer", heading)
    tokens, layer = (int(m.group(1)), m.group(2)) if m else (None, None)
    _, stage_rows = _find(tables, "stages")
    key_cols = ("model", "P", "kv", "transport", "variant")
    runs, by_key = [], {}
    for i, row in enumerate(summary):
        where = f"markdown summary row {i + 1}"
        for c in key_cols:
            if c not in row:
                raise ValueError(f"{where}: column '{c}' missing")
        speed = row.get("speedup vs collect", "-")
        run = {"model": row["model"], "pcp": int(_num(row, "P", where)), "kv_format": row["kv"],
               "transport": row["transport"], "variant": row["variant"], "stages": [],
               "total_ms": _num(row, "layer ms", where), "floor_ms": _num(row, "floor ms", where),
               "time_over_floor": _num(row, "time/floor", where)}
        if tokens is not None:
            run.update(tokens=tokens, layer=layer)
        if speed not in ("-", "") and row["transport"] != "collect":
            run["speedup_vs_collect"] = _num(row, "speedup vs collect", where, suffix="x")
        by_key.setdefault(tuple(row[c] for c in key_cols), run)  # the first run of a key owns its stages
        runs.append(run)
    for i, row in enumerate(stage_rows):
        where = f"markdown stages row {i + 1}"
        if row.get("transport") == "replica-check":
            continue  # the run-time replica check: timed on its own, in no transport total (docs/perf.md 15)
        run = by_key.get(tuple(row.get(c) for c in key_cols))
        if run is None:
            raise ValueError(f"{where}: no summary row for {[row.get(c) for c in key_cols]}")
        run["stages"].append({"name": row.get("stage") or "?", "ms": _num(row, "ms", where),
                              "bytes": _num(row, "MB", where) * 1e6})
    heading, singles = _find(tables, "dispatch alone", required=False)
    m = re.search(r"\(([^,]+), ([^,]+),", heading or "")
    model, kv = (m.group(1).lower(), m.group(2)) if m else ("?", "?")
    doc["single_rank"] = []
    for i, row in enumerate(singles):
        where = f"markdown single-rank row {i + 1}"
        single = {"model": model, "kv_format": kv, "tokens": int(_num(row, "tokens", where)),
                  "variant": row.get("variant", "?"), "fused_topk": (row.get("top-k fill") or "").split(",")[0] == "fused",
                  "ms": _num(row, "time us", where) / 1e3, "floor_ms": _num(row, "floor us", where) / 1e3,
                  "time_over_floor": _num(row, "time / floor", where)}
        if row.get("graph us") not in (None, "-", ""):  # tables since 2026-12-03 (graph replays); "-": not measured
            single["graph_ms"] = _num(row, "graph us", where) / 1e3
        doc["single_rank"].append(single)
    doc["runs"] = runs
    return doc
