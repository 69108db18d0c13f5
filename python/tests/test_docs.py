"""The documents cannot rot: every ```python block of README.md, python/README.md and docs/python.md runs as
written (on the CPU, with the built extension), README.md's headline table equals docs/results/headline.json, and
docs/cli.md's flag lists equal the built CLI's --help.

Convention: a ```python block runs unless the line before it is `<!-- no-run: why -->` (multi-process or GPU-only
code, or code that needs an engine's tensors). The blocks of one file run in order in one namespace (a file may
set up names once), with the repository root as the working directory. A block that needs an optional package
that is missing (transformers) skips with the reason; so does every block when torch or the extension is missing."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ("README.md", "python/README.md", "docs/python.md")
OPTIONAL = ("transformers",)  # packages a block may need that the CPU test environment need not have
NO_RUN = re.compile(r"^<!--\s*no-run:\s*\S.*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")


def code_blocks(text: str):
    """[(first line number, language, code, runnable)] of the fenced blocks of a markdown text. A block is runnable
    when its language is python and the nearest non-blank line before its fence is a no-run marker."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise ValueError(f"line {i + 1}: a ``` block that never closes")
        prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        lang = m.group(1)
        blocks.append((i + 1, lang, "\n".join(lines[i + 1:j]) + "\n", lang == "python" and not NO_RUN.match(prev)))
        i = j + 1
    return blocks


def runnable(path: str):
    with open(os.path.join(ROOT, path)) as f:
        return [(line, code) for line, _, code, run in code_blocks(f.read()) if run]


def test_code_blocks_are_found_and_no_run_is_honoured():
    text = "x\n```python\na = 1\n```\n<!-- no-run: needs torchrun -->\n\n```python\nraise SystemExit\n```\n" \
           "```bash\nfalse\n```\n"
    assert [(b[0], b[1], b[3]) for b in code_blocks(text)] == [(2, "python", True), (7, "python", False),
                                                                (10, "bash", False)]
    # each document keeps examples that run (a renamed fence or a marker on everything would test nothing)
    counts = {p: len(runnable(p)) for p in DOCS}
    assert counts["README.md"] >= 1 and counts["python/README.md"] >= 3 and counts["docs/python.md"] >= 10, counts


@pytest.mark.parametrize("path", DOCS)
def test_python_blocks_run_as_written(path, monkeypatch):
    pytest.importorskip("torch", reason="torch is not installed")
    try:
        import pcpkv_torch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"pcpkv_torch is not importable: {e}")
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__doc_example__"}
    for line, code in runnable(path):
        try:
            exec(compile(code, f"{path}:{line}", "exec"), namespace)  # noqa: S102 - the documents' own examples
        except ModuleNotFoundError as e:
            if e.name in OPTIONAL:
                pytest.skip(f"{path}:{line} needs {e.name}, which is not installed")
            raise


def run_script(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", args[0]), *args[1:]], capture_output=True,
                          text=True, timeout=120)


def test_headline_table_matches_its_file():
    r = run_script("headline.py", "--check")
    assert r.returncode == 0, r.stderr


def test_headline_check_fails_on_a_stale_table_and_a_number_without_its_date(tmp_path):
    readme = tmp_path / "README.md"
    text = open(os.path.join(ROOT, "README.md")).read()
    assert "**3.09x / 1.81x" in text
    readme.write_text(text.replace("**3.09x / 1.81x", "**3.10x / 1.81x", 1))
    r = run_script("headline.py", "--check", "--readme", str(readme))
    assert r.returncode == 1 and "differs from" in r.stderr, r.stderr
    bad = tmp_path / "headline.json"
    bad.write_text('{"rows": [{"what": "w", "result": "1x", "date": "", "device": "d", "command": "c", '
                   '"source": "s"}]}')
    r = run_script("headline.py", "--check", "--json", str(bad))
    assert r.returncode == 2 and "rows[0].date" in r.stderr, r.stderr


def cli_binary():
    # scripts/test.sh's rule: PCPKV_BUILD_DIR, relative to the repository root, else build/
    path = os.path.join(ROOT, os.environ.get("PCPKV_BUILD_DIR") or "build", "pcpkv")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no built CLI at {path} (PCPKV_BUILD_DIR names the build directory)")
    return path


def test_cli_flag_lists_match_the_cli():
    r = run_script("cli_help.py", "--check", cli_binary())
    assert r.returncode == 0, r.stderr


def test_cli_help_check_fails_when_a_flag_is_missing(tmp_path):
    binary = cli_binary()
    doc = tmp_path / "cli.md"
    shutil.copy(os.path.join(ROOT, "docs", "cli.md"), doc)
    text = doc.read_text()
    line = next(ln for ln in text.split("\n") if ln.lstrip().startswith("--check-replicas"))
    doc.write_text(text.replace(line + "\n", "", 1))
    r = run_script("cli_help.py", "--check", "--doc", str(doc), binary)
    assert r.returncode == 1 and "differs from" in r.stderr, r.stderr
