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
    mapped = {name for name in config["package-dir"] if name != "compiled_llm"}
    assert on_disk | mapped == listed
    for name, folder in config["package-dir"].items():
        assert (ROOT / folder / "__init__.py").is_file(), name
