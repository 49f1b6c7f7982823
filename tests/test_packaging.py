"""pyproject.toml lists every package of the source tree (a wheel built from it lacks any it
does not list, and the editable install used in development would not show it)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "compiled_llm").rglob("__init__.py")}
    assert on_disk == listed


def test_no_top_level_package_beside_compiled_llm():
    """A checkout on sys.path (pytest's rootdir, `python -m` from it, PYTHONPATH on a GPU machine)
    exposes every package folder at its root under its own name: a `kernels/` there shadowed the
    PyPI distribution `kernels`, which transformers imports, and broke every model load."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages <= {"compiled_llm", "tests"}, packages


def test_kernel_sources_are_package_data():
    """The C++ kernels are compiled on the user's machine: a wheel without them falls back to torch."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config["package-data"]["compiled_llm.kernels"]
    csrc = ROOT / "compiled_llm" / "kernels"
    found = {p for pattern in patterns for p in csrc.glob(pattern)}
    assert found == set(csrc.glob("csrc/*.*")) and found
