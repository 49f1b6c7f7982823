"""`compiled-llm cache import` of an archive cut short (an interrupted CI artifact download) or
carrying a time no file can have, and `cache export` to a path it cannot write: one line and exit 1
(or, for the time, an import), no traceback and nothing written. Built by hand: no engine."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from compiled_llm.entrypoints.cli import main

KEY = "0123456789abcdef"
DATA = b"hello, compile cache"


def archive(path: Path, mode: str = "w", pax: dict[str, str] | None = None) -> Path:
    index = json.dumps({"version": 2, "key": KEY, "files": {
        "artifacts/a.bin": {"sha256": hashlib.sha256(DATA).hexdigest(), "bytes": len(DATA)}}}).encode()
    with tarfile.open(path, mode, format=tarfile.PAX_FORMAT) as tar:
        for name, data in ((f"{KEY}/index.json", index), (f"{KEY}/artifacts/a.bin", DATA)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.pax_headers = dict(pax or {})
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("mode, suffix", [("w", "tar"), ("w:gz", "tar.gz"), ("w:xz", "tar.xz")])
def test_a_truncated_archive_is_refused_in_one_line(tmp_path, capsys, mode, suffix):
    whole = archive(tmp_path / f"whole.{suffix}", mode).read_bytes()
    cut = tmp_path / f"cut.{suffix}"
    cut.write_bytes(whole[:1024 + 512 + 5] if mode == "w" else whole[: len(whole) // 2])  # inside a member
    status = main(["cache", "import", str(cut), "--compile-cache", str(tmp_path / "root")])
    err = capsys.readouterr().err
    assert status == 1 and "truncated or damaged" in err and err.count("\n") == 1, err
    assert not (tmp_path / "root" / KEY).exists()
    assert not [p for p in (tmp_path / "root").glob(".*") if not p.name.endswith(".lock")]


@pytest.mark.parametrize("mtime", ["1e400", "1e30", "nan"])
def test_a_member_time_no_file_can_have_is_ignored(tmp_path, capsys, mtime):
    good = archive(tmp_path / "odd.tar", pax={"mtime": mtime})
    assert main(["cache", "import", str(good), "--compile-cache", str(tmp_path / "root")]) == 0
    assert (tmp_path / "root" / KEY / "artifacts" / "a.bin").read_bytes() == DATA
    assert main(["cache", "verify", "--compile-cache", str(tmp_path / "root")]) == 0


def test_export_to_a_folder_is_one_line_and_leaves_nothing(tmp_path, capsys):
    root = tmp_path / "root"
    assert main(["cache", "import", str(archive(tmp_path / "entry.tar")), "--compile-cache", str(root)]) == 0
    folder = tmp_path / "out"
    folder.mkdir()
    status = main(["cache", "export", KEY, "-o", str(folder), "--compile-cache", str(root)])
    err = capsys.readouterr().err
    assert status == 1 and f"cannot write {folder}" in err and err.count("\n") == 1, err
    assert list(folder.iterdir()) == [] and not list(tmp_path.glob(".out.*"))
