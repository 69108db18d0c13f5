"""Which pcpkv_torch the tests import, and this folder (helpers.py) on sys.path.

The in-place build (python/pcpkv_torch/_C*.so from `python setup.py build_ext --inplace`) wins when it
exists: python/ goes first on sys.path. Otherwise python/ is taken off sys.path (pytest run from python/
puts it there), so that the installed package (`pip install --no-build-isolation ./python`) is imported
instead of the source tree, which has no extension. The pytest header says which one was imported. Each
test module itself skips, with the reason, when torch or the extension is missing (helpers.py)."""

import glob
import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(TESTS)  # python/: the source tree of pcpkv_torch
IN_PLACE = sorted(glob.glob(os.path.join(SOURCE, "pcpkv_torch", "_C*.so")) +
                  glob.glob(os.path.join(SOURCE, "pcpkv_torch", "_C*.pyd")))


def _is_source(entry: str) -> bool:
    return os.path.realpath(os.path.abspath(entry or os.getcwd())) == os.path.realpath(SOURCE)


if IN_PLACE:
    sys.path.insert(0, SOURCE)
else:
    sys.path[:] = [p for p in sys.path if not _is_source(p)]
sys.path.insert(0, TESTS)


def pytest_report_header(config):
    try:
        import pcpkv_torch
    except Exception as e:  # noqa: BLE001 - any import failure is reported, the modules skip
        return [f"pcpkv_torch: not importable ({type(e).__name__}: {e})"]
    where = os.path.dirname(os.path.abspath(pcpkv_torch.__file__))
    kind = "in-place build" if _is_source(os.path.dirname(where)) else "installed package"
    ext = getattr(getattr(pcpkv_torch, "_C", None), "__file__", "?")
    return [f"pcpkv_torch: {kind} at {where} (extension {ext})"]
