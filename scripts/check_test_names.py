#!/usr/bin/env python3
"""Every INSTANTIATE_TEST_SUITE_P under tests/ names its cases (run by the unit tier; exit 1 lists each one that
does not).

ctest names a discovered test by its GoogleTest name (tests/CMakeLists.txt: gtest_discover_tests NO_PRETTY_VALUES),
so a case without a name generator is called by its index, /0, /1, ...; before NO_PRETTY_VALUES a struct parameter
without PrintTo was named by its bytes, uninitialised padding included, and the names changed between runs. A name
generator (the fourth argument; tests/support/param_names.h, or ::testing::PrintToStringParamName() for a number)
gives stable, readable names. Checks the sources, so CUDA-only files a CPU build does not compile are covered too.
"""
import os
import re
import sys


def split_args(text, start):
    """The top-level arguments of the call whose '(' is at text[start], and where it ends."""
    depth, args, arg, i = 0, [], [], start
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
            if depth > 1:
                arg.append(ch)
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append("".join(arg).strip())
                return args, i
            arg.append(ch)
        elif ch == "," and depth == 1:
            args.append("".join(arg).strip())
            arg = []
        elif ch == '"':  # a string literal: its commas and brackets are not the call's
            end = i + 1
            while text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            arg.append(text[i:end + 1])
            i = end
        else:
            arg.append(ch)
        i += 1
    raise ValueError("unbalanced parentheses")


def unnamed(path):
    text = open(path, encoding="utf-8").read()
    for m in re.finditer(r"^[ \t]*INSTANTIATE_TEST_SUITE_P\s*\(", text, re.M):
        args, _ = split_args(text, m.end() - 1)
        if len(args) < 4:
            yield text.count("\n", 0, m.start()) + 1, args[:2]


def main(root):
    bad = []
    for folder, _, files in os.walk(os.path.join(root, "tests")):
        for name in sorted(files):
            if name.endswith((".cpp", ".cu", ".h")):
                path = os.path.join(folder, name)
                bad += [f"{os.path.relpath(path, root)}:{line}: INSTANTIATE_TEST_SUITE_P({', '.join(what)}, ...) has "
                        "no name generator" for line, what in unnamed(path)]
    for b in bad:
        print(b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
