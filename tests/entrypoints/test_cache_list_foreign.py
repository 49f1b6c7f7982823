"""`compiled-llm cache list` over an entry whose factors.json is JSON no start writes (an imported
archive's, which nothing vouches for when unsigned): the entry is listed with "?" where its model
and flags would be, instead of a traceback that hides every other entry. No engine needed."""

from __future__ import annotations

import json

import pytest

from compiled_llm.entrypoints.cli import main

KEY = "0123456789abcdef"


@pytest.mark.parametrize("factors", [
    {"model_config": {"architectures": 5}}, {"compile_ranges": [1]}, {"compile_sizes": 3},
    {"quantization": {"method": {}}, "model_config": {"architectures": [{}]}},
])
def test_a_foreign_factors_file_is_listed_not_a_crash(tmp_path, capsys, factors):
    entry = tmp_path / KEY
    entry.mkdir()
    (entry / "factors.json").write_text(json.dumps(factors))
    assert main(["cache", "list", "--compile-cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert KEY in out and "unfinished" in out
    assert main(["cache", "list", "--json", "--compile-cache", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)[0]["key"] == KEY
