"""A generated block of a document, between two marker lines: rewrite it, or check that it is current.
Shared by scripts/headline.py (README.md's headline table) and scripts/cli_help.py (docs/cli.md's flag lists)."""

import sys


def update(path: str, begin: str, end: str, block: str, *, check: bool, tool: str, source: str) -> int:
    """0 when `path`'s block between `begin` and `end` equals `block` (or was rewritten to it); with check, 1 and a
    line on stderr naming the file, the source and the command that rewrites it. Raises ValueError without markers."""
    with open(path) as f:
        old = f.read()
    i, j = old.find(begin), old.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{path} has no '{begin}' ... '{end}' markers")
    new = old[:i + len(begin)] + "\n" + block + "\n" + old[j:]
    if new == old:
        return 0
    if check:
        print(f"{tool}: {path}'s generated block differs from {source}; run python3 scripts/{tool}", file=sys.stderr)
        return 1
    with open(path, "w") as f:
        f.write(new)
    return 0
