#!/usr/bin/env python3
"""Draws the JSON of `pcpkv bench --json FILE` as stage bars per transport and writes a PNG.

One horizontal bar per run (model / PCP / kv format / layer / tokens, then transport and variant), stacked
from its stages (`runs[i].stages[j].ms`, one colour per stage name), a black marker at the run's byte floor
(`floor_ms`) and its time / floor and speedup over collect at the bar's end. The single-rank dispatch cases
(`single_rank`, when present) get a panel of their own. Times are drawn in microseconds.

Usage: python3 scripts/plot_bench.py BENCH.json [-o OUT.png] [--title TEXT]   (default OUT: BENCH.png)
A file ending in .md is read as `pcpkv bench --markdown` output instead (scripts/bench_markdown.py: runs saved
before JSON was kept, e.g. docs/results/).
Needs matplotlib: `python3 -m pip install -r scripts/requirements-plot.txt` (pinned, tested versions) or
`python3 -m pip install matplotlib`. Exit status: 0 written; 1 the JSON is unreadable or malformed (the
message names the field, e.g. `runs[2].stages[0].ms`); 2 matplotlib is missing or the command line is wrong.
The JSON is checked before matplotlib is imported, so a malformed file is reported either way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field

INSTALL_HINT = ("matplotlib is not installed; install it with `python3 -m pip install -r "
                "scripts/requirements-plot.txt` (or `python3 -m pip install matplotlib`)")


class BenchJsonError(ValueError):
    """A malformed bench JSON; the message names the field."""


@dataclass
class Bar:
    group: str                 # the case: model, P, kv format, layer, tokens
    label: str                 # transport and variant
    stages: list = field(default_factory=list)  # [(name, ms)]
    total_ms: float = 0.0
    floor_ms: float | None = None
    note: str = ""


def _get(obj: dict, key: str, where: str, kind, *, required=True, minimum=None):
    """obj[key] checked to be of `kind` ("number", "int", "str", "bool", "list"); None when absent or null
    and not required. Raises BenchJsonError naming where.key."""
    name = f"{where}.{key}" if where else key
    if not isinstance(obj, dict):
        raise BenchJsonError(f"{where or 'the document'}: expected an object, got {type(obj).__name__}")
    v = obj.get(key)
    if v is None:
        if required:
            raise BenchJsonError(f"{name}: missing")
        return None
    ok = {"number": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          "int": isinstance(v, int) and not isinstance(v, bool),
          "str": isinstance(v, str), "bool": isinstance(v, bool), "list": isinstance(v, list)}[kind]
    if not ok:
        raise BenchJsonError(f"{name} = {v!r}: expected a{'n' if kind[0] in 'aeiou' else ''} {kind}")
    if minimum is not None and v < minimum:
        raise BenchJsonError(f"{name} = {v!r}: must be >= {minimum}")
    return v


def _case(r: dict, where: str) -> str:
    parts = [_get(r, "model", where, "str")]
    pcp = _get(r, "pcp", where, "int", required=False, minimum=1)
    if pcp is not None:
        parts.append(f"P{pcp}")
    parts.append(_get(r, "kv_format", where, "str"))
    for key, fmt in (("layer", "{} layer"), ("tokens", "{} tok")):
        v = _get(r, key, where, "int" if key == "tokens" else "str", required=False)
        if v is not None:
            parts.append(fmt.format(v))
    return " ".join(str(p) for p in parts)


def parse(doc) -> tuple[list[Bar], list[Bar], str]:
    """The bars of the stage runs and of the single-rank cases, and a subtitle (device, copy bandwidth).
    Raises BenchJsonError naming the first bad field."""
    if not isinstance(doc, dict):
        raise BenchJsonError(f"the document: expected a JSON object (pcpkv bench --json), got {type(doc).__name__}")
    runs = _get(doc, "runs", "", "list", required=False) or []
    singles = _get(doc, "single_rank", "", "list", required=False) or []
    if not runs and not singles:
        raise BenchJsonError("runs: missing or empty (and no single_rank cases): nothing to plot")
    bars = []
    for i, r in enumerate(runs):
        w = f"runs[{i}]"
        bar = Bar(_case(r, w), f"{_get(r, 'transport', w, 'str')} {_get(r, 'variant', w, 'str', required=False) or ''}".strip(),
                  total_ms=_get(r, "total_ms", w, "number", minimum=0),
                  floor_ms=_get(r, "floor_ms", w, "number", required=False, minimum=0))
        stages = _get(r, "stages", w, "list")
        if not stages:
            raise BenchJsonError(f"{w}.stages: empty")
        for j, s in enumerate(stages):
            bar.stages.append((_get(s, "name", f"{w}.stages[{j}]", "str"),
                               _get(s, "ms", f"{w}.stages[{j}]", "number", minimum=0)))
        notes = []
        ratio = _get(r, "time_over_floor", w, "number", required=False)
        if ratio is not None:
            notes.append(f"{ratio:.2f}x floor")
        speedup = _get(r, "speedup_vs_collect", w, "number", required=False)
        if speedup is not None and not bar.label.startswith("collect"):
            notes.append(f"{speedup:.2f}x vs collect")
        bar.note = ", ".join([f"{bar.total_ms * 1e3:.0f} us"] + notes)
        bars.append(bar)
    single_bars = []
    for i, s in enumerate(singles):
        w = f"single_rank[{i}]"
        ms = _get(s, "ms", w, "number", minimum=0)
        fused = _get(s, "fused_topk", w, "bool", required=False)
        fill = "" if fused is None else (" fused fill" if fused else " separate fill")
        b = Bar(f"{_get(s, 'model', w, 'str')} {_get(s, 'kv_format', w, 'str', required=False) or ''} "
                f"{_get(s, 'tokens', w, 'int', minimum=1)} tok".replace("  ", " "),
                f"{_get(s, 'variant', w, 'str')}{fill}", stages=[("dispatch", ms)], total_ms=ms,
                floor_ms=_get(s, "floor_ms", w, "number", required=False, minimum=0))
        ratio = _get(s, "time_over_floor", w, "number", required=False)
        b.note = f"{ms * 1e3:.1f} us" + (f", {ratio:.2f}x floor" if ratio is not None else "")
        single_bars.append(b)
    device = doc.get("device") if isinstance(doc.get("device"), dict) else {}
    sub = []
    if isinstance(device.get("name"), str):
        sub.append(device["name"])
    bw = _get(doc, "copy_bandwidth_gbps", "", "number", required=False)
    if bw is not None:
        sub.append(f"copy {bw:.0f} GB/s")
    return bars, single_bars, ", ".join(sub)


def _draw(ax, bars: list[Bar], colors: dict, title: str, xlabel: str):
    """Stacked horizontal bars, cases separated by a gap, top to bottom in the JSON's order."""
    y, ticks, labels, y_of_group = 0.0, [], [], []
    last_group = None
    for b in bars:
        if b.group != last_group:
            if last_group is not None:
                y += 0.6
            y_of_group.append((y, b.group))
            last_group = b.group
        left = 0.0
        for name, ms in b.stages:
            ax.barh(y, ms * 1e3, left=left, color=colors[name], edgecolor="white", linewidth=0.5, height=0.8)
            left += ms * 1e3
        if b.floor_ms is not None:
            ax.plot([b.floor_ms * 1e3], [y], marker="|", color="black", markersize=18, markeredgewidth=2.5)
        ax.text(max(left, (b.floor_ms or 0) * 1e3) * 1.01, y, " " + b.note, va="center", fontsize=8)
        ticks.append(y)
        labels.append(b.label)
        y += 1.0
    for gy, g in y_of_group:
        ax.text(0, gy - 0.55, g, fontsize=9, fontweight="bold", va="bottom")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(y - 0.4, -1.2)
    ax.set_xlabel(xlabel)
    right = max(max(sum(ms for _, ms in b.stages), b.floor_ms or 0) for b in bars) * 1e3
    ax.set_xlim(0, right * 1.45)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def plot(bars: list[Bar], single_bars: list[Bar], subtitle: str, out: str, title: str | None):
    import matplotlib  # checked by main() first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names = []
    for b in bars + single_bars:
        for n, _ in b.stages:
            if n not in names:
                names.append(n)
    cmap = plt.get_cmap("tab10")
    colors = {n: cmap(i % 10) for i, n in enumerate(names)}
    panels = [(bars, "one layer's publication, stages per transport", "time per layer (us)"),
              (single_bars, "single-rank dispatch (with top-k fill)", "time (us)")]
    panels = [p for p in panels if p[0]]
    heights = [len(p[0]) + 0.6 * len({b.group for b in p[0]}) + 1.5 for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 0.32 * sum(heights) + 1.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (pbars, ptitle, xlabel) in zip(axes[:, 0], panels):
        _draw(ax, pbars, colors, ptitle, xlabel)
    handles = [Patch(color=colors[n], label=n) for n in names]
    handles.append(Line2D([], [], marker="|", color="black", linestyle="none", markersize=12, markeredgewidth=2,
                          label="floor (bytes / copy bandwidth)"))
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=min(len(handles), 5), frameon=False)
    fig.suptitle(title or ("pcpkv bench" + (f" ({subtitle})" if subtitle else "")), fontsize=11, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json_file", help="the file of `pcpkv bench --json FILE` (or of --markdown: *.md)")
    ap.add_argument("-o", "--output", help="PNG to write (default: the JSON's name with .png)")
    ap.add_argument("--title", help="figure title (default: pcpkv bench, device and copy bandwidth)")
    a = ap.parse_args(argv)
    out = a.output or os.path.splitext(a.json_file)[0] + ".png"
    try:
        with open(a.json_file, encoding="utf-8") as f:
            if a.json_file.endswith(".md"):
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                from bench_markdown import read_markdown

                doc = read_markdown(f.read())
            else:
                doc = json.load(f)
        bars, single_bars, subtitle = parse(doc)
    except OSError as e:
        print(f"plot_bench: error: cannot read {a.json_file}: {e.strerror}", file=sys.stderr)
        return 1
    except json.JSONDecodeError as e:
        print(f"plot_bench: error: {a.json_file} is not valid JSON: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # BenchJsonError, or a malformed markdown table
        print(f"plot_bench: error: {a.json_file}: {e}", file=sys.stderr)
        return 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"plot_bench: error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    plot(bars, single_bars, subtitle, out, a.title)
    print(f"plot_bench: wrote {out} ({len(bars)} runs, {len(single_bars)} single-rank cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
