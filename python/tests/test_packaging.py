"""The wheel ships every package and data file of python/pcpkv_torch (issue 32: setup.py listed only
`pcpkv_torch`, so pcpkv_torch.models and pcpkv_torch.examples were missing after `pip install`).

The wheel is PCPKV_WHEEL, the one scripts/test_wheel.sh builds (`pip wheel --no-build-isolation ./python`,
CPU ops); without it that test skips, since building one compiles the extension. The source side is every file
under python/pcpkv_torch but build outputs, so a new subpackage or data file that does not ship fails it."""

import os
import zipfile

import pytest

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # python/
PACKAGE = os.path.join(SOURCE, "pcpkv_torch")
EXTENSION_SUFFIXES = (".so", ".pyd")


def _is_build_output(name):
    return name.endswith(EXTENSION_SUFFIXES + (".pyc",))


def source_files():
    """Every file of the package's source tree, as a wheel names it ("pcpkv_torch/models/hf.py")."""
    files = set()
    for d, dirs, names in os.walk(PACKAGE):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for n in names:
            if not _is_build_output(n):
                files.add(os.path.relpath(os.path.join(d, n), SOURCE).replace(os.sep, "/"))
    return files


def wheel_problems(wheel_names, expected):
    """What is wrong with a wheel's file list: a source file missing, no extension, a file that is neither."""
    names = {n for n in wheel_names if not n.endswith("/")}
    problems = [f"missing from the wheel: {f}" for f in sorted(expected - names)]
    extensions = [n for n in names if n.startswith("pcpkv_torch/_C") and n.endswith(EXTENSION_SUFFIXES)]
    if len(extensions) != 1:
        problems.append(f"the wheel holds {len(extensions)} pcpkv_torch/_C extensions, not 1: {extensions}")
    for n in sorted(names - expected - set(extensions)):
        if not n.split("/")[0].endswith(".dist-info"):
            problems.append(f"in the wheel but not a source file of pcpkv_torch: {n}")
    return problems


def test_every_folder_of_modules_is_a_package():
    # Package discovery (pyproject.toml: packages.find) ships folders with an __init__.py only.
    for d, dirs, names in os.walk(PACKAGE):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        if any(n.endswith(".py") for n in names):
            where = os.path.relpath(d, SOURCE)
            assert "__init__.py" in names, f"{where} has modules but no __init__.py: it would not ship"


def test_wheel_problems_names_a_missing_subpackage():
    expected = {"pcpkv_torch/__init__.py", "pcpkv_torch/models/__init__.py"}
    assert wheel_problems(["pcpkv_torch/__init__.py", "pcpkv_torch/_C.cpython-312-x86_64-linux-gnu.so"], expected) == [
        "missing from the wheel: pcpkv_torch/models/__init__.py"]


def test_wheel_ships_every_package_and_data_file():
    wheel = os.environ.get("PCPKV_WHEEL")
    if not wheel:
        pytest.skip("PCPKV_WHEEL is not set (scripts/test_wheel.sh builds the wheel and sets it)")
    with zipfile.ZipFile(wheel) as z:
        problems = wheel_problems(z.namelist(), source_files())
    assert not problems, f"{wheel}:\n" + "\n".join(problems)
