"""`compiled-llm cache`: list, verify, prune, explain, export and import on real entries.

One `compiled-llm precompile` of a tiny Llama fills a cache folder per module; each test works on
a copy of it. The subcommands run in this process (`cli.main`), except what must be another
process: a start that holds an entry's lock, and the warm start after an import.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.compilation.compile_cache import CompileCache, signature
from compiled_llm.entrypoints.cli import main

TINY_FLAGS = ["--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "8"]
SECRET = b"a signing key for the cache cli tests, 0123"


def precompile(model: str, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["compiled-llm", "precompile", model, "--compile-cache", str(cache), "--json", *TINY_FLAGS,
                           *extra], capture_output=True, text=True, timeout=900)


def last_json(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def filled(tmp_path_factory, tiny_llama) -> tuple[Path, str]:
    """(a cache root holding one complete, unsigned entry made by precompile, its key)."""
    root = tmp_path_factory.mktemp("cache-cli") / "cache"
    result = last_json(precompile(tiny_llama, root))
    assert result["inductor_compilations"] > 0
    return root, Path(result["cache_dir"]).name


@pytest.fixture()
def cache(filled, tmp_path) -> tuple[Path, str]:
    root, key = filled
    dest = tmp_path / "cache"
    shutil.copytree(root, dest, symlinks=True)
    return dest, key


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "cache.key"
    path.write_bytes(SECRET + b"\n")
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["cache", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def flip(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def sign(entry: Path, secret: bytes = SECRET) -> None:
    """What precompile with --cache-signing-key-file writes."""
    (entry / "manifest.sig").write_text(signature(secret, (entry / "index.json").read_bytes()))


def copy_entry(root: Path, key: str, name: str) -> Path:
    """The entry copied under another key (its index says which key it is for)."""
    shutil.copytree(root / key, root / name)
    index = json.loads((root / name / "index.json").read_text())
    (root / name / "index.json").write_text(json.dumps({**index, "key": name}))
    return root / name


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def hold_lock(root: Path, key: str) -> subprocess.Popen:
    """Another process holding the entry's lock, as a start that fills or loads it does."""
    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(root / f".{key}.lock")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ---- list -----------------------------------------------------------------------------------------
def test_list_shows_each_entry_with_its_model_flags_and_state(cache, tiny_llama, capsys, key_file):
    root, key = cache
    status, text, _ = run(capsys, "list", "--compile-cache", str(root))
    assert status == 0
    assert key in text and "complete" in text and "unsigned" in text
    assert tiny_llama in text and "LlamaForCausalLM, 2 layers, hidden 64" in text
    assert "--dtype float32 --max-num-batched-tokens 64" in text
    # A signed copy, a truncated one, an unfinished one, and strangers in the folder.
    for name, change in (("0000000000000001", "sign"), ("0000000000000002", "truncate"),
                         ("0000000000000003", "unfinished")):
        copy_entry(root, key, name)
        if change == "sign":
            sign(root / name)
        elif change == "truncate":
            victim = sorted((root / name / "artifacts").glob("*.bin"))[0]
            victim.write_bytes(victim.read_bytes()[:10])
        else:
            (root / name / "index.json").unlink()
    (root / "notes").mkdir()
    (root / f"{key}.broken-20260101-000000-1").mkdir()
    (root / "stray.txt").write_text("not an entry")
    status, text, _ = run(capsys, "list", "--json", "--compile-cache", str(root))
    rows = {row["key"]: row for row in json.loads(text)}
    assert status == 0 and set(rows) == {key, "0000000000000001", "0000000000000002", "0000000000000003"}
    mine = rows[key]
    assert (mine["status"], mine["signed"], mine["in_use"], mine["problems"]) == ("complete", False, False, [])
    assert mine["size"] == sum(p.stat().st_size for p in (root / key).rglob("*") if p.is_file())
    assert mine["created"] and mine["last_used"] and mine["model"].startswith(tiny_llama)
    assert mine["factors"]["max_num_batched_tokens"] == 64 and "sources" not in mine["factors"]
    assert rows["0000000000000001"]["signed"] is True
    assert rows["0000000000000002"]["status"] == "damaged" and "truncated" in rows["0000000000000002"]["problems"][0]
    assert rows["0000000000000003"]["status"] == "unfinished"
    with_key = json.loads(run(capsys, "list", "--json", "--compile-cache", str(root),
                              "--cache-signing-key-file", str(key_file))[1])
    by_key = {row["key"]: row["status"] for row in with_key}
    assert by_key[key] == "damaged"  # unsigned, and a key is given


def test_list_and_verify_of_an_empty_or_missing_folder(tmp_path, capsys):
    for sub in ("list", "verify"):
        status, text, _ = run(capsys, sub, "--compile-cache", str(tmp_path / "none"))
        assert status == 0 and "no compile cache entries" in text
    assert not (tmp_path / "none").exists()


# ---- verify ---------------------------------------------------------------------------------------
def test_verify_checks_every_file_and_names_the_damage(cache, capsys):
    root, key = cache
    status, text, _ = run(capsys, "verify", "--compile-cache", str(root))
    files = len(json.loads((root / key / "index.json").read_text())["files"])
    assert status == 0 and f"{key}: ok, {files} files checked, unsigned" in text
    victim = sorted((root / key / "inductor").rglob("*.so"))[0]
    flip(victim, 4000)  # same size: only a checksum finds it
    (root / key / "artifacts" / "planted.bin").write_bytes(b"nobody listed me")
    before = tree(root)
    status, text, err = run(capsys, "verify", key[:6], "--compile-cache", str(root))
    assert status == 1 and "1 of 1 entries damaged" in err
    assert f"{key}: {victim} does not match its checksum" in text
    assert f"{key}: {root / key / 'artifacts' / 'planted.bin'} is not listed in the index" in text
    assert tree(root) == before  # nothing moved or written


def test_verify_checks_the_signature_with_a_key(cache, key_file, tmp_path, capsys):
    root, key = cache
    flags = ["--compile-cache", str(root), "--cache-signing-key-file", str(key_file)]
    status, text, _ = run(capsys, "verify", *flags)
    assert status == 1 and "index.json is not signed" in text
    sign(root / key)
    status, text, _ = run(capsys, "verify", *flags)
    assert status == 0 and "signature checked" in text
    status, text, _ = run(capsys, "verify", "--compile-cache", str(root))
    assert status == 0 and "signature not checked" in text
    other = tmp_path / "other.key"
    other.write_bytes(b"another signing key, 0123456789")
    status, text, _ = run(capsys, "verify", "--compile-cache", str(root), "--cache-signing-key-file", str(other))
    assert status == 1 and "does not match its signature" in text


def test_verify_an_unknown_key_is_one_line(cache, capsys):
    root, _ = cache
    status, _, err = run(capsys, "verify", "ffffffff", "--compile-cache", str(root))
    assert status == 1 and err.count("\n") == 1 and "no entry" in err and "match 'ffffffff'" in err


# ---- prune ----------------------------------------------------------------------------------------
def entries_used(root: Path, key: str, ages_h: list[float]) -> list[str]:
    """Copies of the entry under new keys, last used `ages_h` hours ago (in the lock file's mtime)."""
    keys = []
    for i, age in enumerate(ages_h):
        name = f"{i + 1:016x}"
        copy_entry(root, key, name)
        lock = root / f".{name}.lock"
        lock.touch()
        stamp = time.time() - age * 3600
        os.utime(lock, (stamp, stamp))
        keys.append(name)
    shutil.rmtree(root / key)
    (root / f".{key}.lock").unlink(missing_ok=True)
    return keys


def present(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_prune_by_age_count_and_size_least_recently_used_first(cache, capsys):
    root, key = cache
    young, middle, old, oldest = entries_used(root, key, [1, 30, 80, 200])
    size = sum(p.stat().st_size for p in (root / young).rglob("*") if p.is_file())
    flags = ["--compile-cache", str(root)]
    status, text, _ = run(capsys, "prune", "--older-than", "2d", "--dry-run", *flags)
    assert status == 0 and f"would remove {old}" in text and f"would remove {oldest}" in text
    assert present(root) == [young, middle, old, oldest]  # a dry run removes nothing
    status, text, _ = run(capsys, "prune", "--older-than", "7d", *flags)
    assert present(root) == [young, middle, old] and f"removed {oldest}" in text
    assert not (root / f".{oldest}.lock").exists()
    status, text, _ = run(capsys, "prune", "--max-size", str(int(size * 2.5)), *flags)
    assert present(root) == [young, middle] and "freed" in text
    status, text, _ = run(capsys, "prune", "--keep-last", "1", *flags)
    assert present(root) == [young]
    status, _, err = run(capsys, "prune", *flags)
    assert status == 1 and "--older-than, --max-size or --keep-last" in err


def test_prune_never_removes_an_entry_another_process_holds(cache, capsys):
    root, key = cache
    held, middle, young = entries_used(root, key, [100, 50, 10])
    size = sum(p.stat().st_size for p in (root / young).rglob("*") if p.is_file())
    flags = ["--compile-cache", str(root)]
    holder = hold_lock(root, held)
    try:
        status, text, _ = run(capsys, "list", "--json", *flags)
        assert {r["key"]: r["in_use"] for r in json.loads(text)} == {held: True, middle: False, young: False}
        # The least recently used entry is held: --max-size takes the next one instead.
        status, text, _ = run(capsys, "prune", "--max-size", str(int(size * 2.5)), *flags)
        assert status == 0 and f"kept {held}: another process holds it" in text and f"removed {middle}" in text
        assert present(root) == [held, young]
        status, text, _ = run(capsys, "prune", "--keep-last", "0", *flags)
        assert present(root) == [held]
    finally:
        holder.communicate("")
    run(capsys, "prune", "--keep-last", "0", *flags)
    assert present(root) == []


# ---- explain --------------------------------------------------------------------------------------
def test_explain_names_the_flag_that_differs_on_a_real_entry(cache, tiny_llama, capsys):
    root, key = cache
    flags = [tiny_llama, "--compile-cache", str(root), *TINY_FLAGS]
    status, text, _ = run(capsys, "explain", *flags)
    assert status == 0 and text.startswith(f"hit: entry {key}")
    status, text, _ = run(capsys, "explain", *flags, "--max-num-batched-tokens", "32")
    assert status == 0 and text.startswith("miss: no entry") and f"nearest entry {key}: 2 factor(s) differ" in text
    assert "  flag --max-num-batched-tokens: 64 in the entry, 32 now" in text
    assert "  flag --compile-ranges: [[1, 64]] in the entry, [[1, 32]] now" in text
    assert main(["precompile", *flags, "--compile-sizes", "1,2", "--explain"]) == 0
    text = capsys.readouterr().out
    assert f"nearest entry {key}: 1 factor(s) differ\n  flag --compile-sizes: [] in the entry, [1, 2] now" in text
    assert not list(root.glob("*.broken-*")) and sorted(p.name for p in root.iterdir() if p.is_dir()) == [key]


@pytest.fixture(scope="module")
def engine_config(tiny_llama, tmp_path_factory):
    from compiled_llm.engine.arg_utils import EngineArgs

    root = tmp_path_factory.mktemp("explain")
    return EngineArgs(model=tiny_llama, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
                      compile_cache=str(root)).create_engine_config()


def _changed(factors: dict, kind: str) -> tuple[dict, str]:
    """The factors with one kind changed, and the line explain must print for it."""
    f = json.loads(json.dumps(factors, default=repr))
    if kind == "model":
        f["model_config"]["hidden_size"] = 128
        return f, "model: config hidden_size 128 in the entry, 64 now"
    if kind == "torch":
        f["torch_version"] = "2.9.0"
        return f, f"torch version: 2.9.0 in the entry, {factors['torch_version']} now"
    if kind == "python":
        f["python"] = "3.10"
        return f, f"Python version: 3.10 in the entry, {factors['python']} now"
    if kind == "device":
        f["device"] = "cpu:x86_64:VecAVX2"
        return f, f"device or vector ISA: cpu:x86_64:VecAVX2 in the entry, {factors['device']} now"
    if kind == "environment":  # an Inductor setting a CI job exported and production does not
        f["inductor_config"]["environment"] = {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
        return f, ("torch Inductor configuration: TORCHINDUCTOR_MAX_AUTOTUNE (environment variable) 1 in the "
                   "entry, absent now")
    if kind == "flag":
        f["quantization"] = {"method": "int8"}
        return f, 'flag --quantization: {"method": "int8"} in the entry, absent now'
    if kind == "sources":
        f["sources"]["compiled_llm.models.llama"] = "0" * 16
        del f["sources"]["compiled_llm.utils"]
        f["sources"]["compiled_llm.models.old_model"] = "1" * 16
        return f, ("package sources: 3 file(s) differ: compiled_llm.models.llama (changed), compiled_llm.utils "
                   "(only now), compiled_llm.models.old_model (only in the entry)")
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["model", "torch", "python", "device", "environment", "flag", "sources"])
def test_explain_names_each_kind_of_factor(engine_config, kind):
    from compiled_llm.entrypoints.cache_cli import explain_lines
    from compiled_llm.worker.cache_factors import engine_cache_factors

    root = Path(engine_config.compilation_config.cache_dir)
    for old in root.iterdir():
        shutil.rmtree(old)
    factors = engine_cache_factors(engine_config, rank=0)
    changed, line = _changed(factors, kind)
    (root / "00000000000000aa").mkdir()
    (root / "00000000000000aa" / "factors.json").write_text(json.dumps(changed))
    far = _changed(_changed(factors, "torch" if kind != "torch" else "python")[0], "device")[0]
    (root / "00000000000000bb").mkdir()  # two factors away: not the nearest
    (root / "00000000000000bb" / "factors.json").write_text(json.dumps(far))
    lines = explain_lines(engine_config)
    assert lines[0].startswith("miss: no entry")
    assert lines[1:] == ["nearest entry 00000000000000aa: 1 factor(s) differ", f"  {line}"]


# ---- export / import ------------------------------------------------------------------------------
def test_export_then_import_starts_warm_with_zero_compilations(cache, tiny_llama, tmp_path, capsys):
    root, key = cache
    archive = tmp_path / "entry.tar.gz"
    status, text, _ = run(capsys, "export", key, "-o", str(archive), "--compile-cache", str(root))
    assert status == 0 and f"exported {key}" in text and "unsigned" in text
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    listed = json.loads((root / key / "index.json").read_text())["files"]
    assert sorted(names) == sorted([f"{key}/index.json", *(f"{key}/{rel}" for rel in listed)])
    fresh = tmp_path / "restored"
    status, text, _ = run(capsys, "import", str(archive), "--compile-cache", str(fresh))
    assert status == 0 and f"{key}: imported" in text
    assert run(capsys, "verify", "--compile-cache", str(fresh))[0] == 0
    assert [p.name for p in fresh.iterdir() if p.is_dir()] == [key]  # no temp folder left
    lock, before = fresh / f".{key}.lock", tree(fresh / key)
    os.utime(lock, (1e9, 1e9))  # last used in 2001
    warm = last_json(precompile(tiny_llama, fresh, "--require-cache-hit"))
    assert warm["inductor_compilations"] == 0 and warm["artifacts_loaded"] > 0
    assert Path(warm["cache_dir"]) == fresh / key
    assert tree(fresh / key) == before and lock.stat().st_mtime > time.time() - 600  # last used: now, in the lock
    status, text, _ = run(capsys, "import", str(archive), "--compile-cache", str(fresh))
    assert status == 0 and "already present and whole: kept it" in text


def test_a_signed_export_imports_only_with_its_key(cache, key_file, tmp_path, capsys):
    root, key = cache
    signed, unsigned = tmp_path / "signed.tar", tmp_path / "unsigned.tar"
    with_key = ["--cache-signing-key-file", str(key_file)]
    assert run(capsys, "export", key, "-o", str(signed), "--compile-cache", str(root), *with_key)[0] == 0
    assert run(capsys, "export", key, "-o", str(unsigned), "--compile-cache", str(root))[0] == 0
    status, text, _ = run(capsys, "import", str(signed), "--compile-cache", str(tmp_path / "a"), *with_key)
    assert status == 0 and (tmp_path / "a" / key / "manifest.sig").is_file()
    assert run(capsys, "verify", "--compile-cache", str(tmp_path / "a"), *with_key)[0] == 0
    status, _, err = run(capsys, "import", str(unsigned), "--compile-cache", str(tmp_path / "b"), *with_key)
    assert status == 1 and "is not signed" in err and not (tmp_path / "b").exists()
    other = tmp_path / "other.key"
    other.write_bytes(b"another signing key, 0123456789")
    status, _, err = run(capsys, "import", str(signed), "--compile-cache", str(tmp_path / "c"),
                         "--cache-signing-key-file", str(other))
    assert status == 1 and "does not match its signature" in err and not (tmp_path / "c").exists()


def test_a_damaged_entry_is_not_exported(cache, tmp_path, capsys):
    root, key = cache
    flip(sorted((root / key / "artifacts").glob("*.bin"))[0])
    status, _, err = run(capsys, "export", key, "-o", str(tmp_path / "x.tar"), "--compile-cache", str(root))
    assert status == 1 and "does not match its checksum" in err
    assert list(tmp_path.glob("*.tar")) == [] and not list(tmp_path.glob(".x.tar*"))


def _hostile(good: Path, out: Path, key: str, change: str) -> None:
    """A copy of the exported archive `good` with one hostile change."""
    with tarfile.open(good) as src, tarfile.open(out, "w") as dst:
        for info in src.getmembers():
            data = src.extractfile(info).read()
            if change == "checksum" and info.name.endswith(".bin"):
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            dst.addfile(info, io.BytesIO(data))
        extra = tarfile.TarInfo()
        if change == "traversal":
            extra.name, extra.size = f"{key}/../../evil.py", 4
        elif change == "absolute":
            extra.name, extra.size = "/tmp/evil.py", 4
        elif change == "symlink":
            extra.name, extra.type, extra.linkname = f"{key}/artifacts/link.bin", tarfile.SYMTYPE, "/etc/passwd"
        elif change == "hardlink":
            extra.name, extra.type, extra.linkname = f"{key}/artifacts/hard.bin", tarfile.LNKTYPE, f"{key}/index.json"
        elif change == "device":
            extra.name, extra.type, extra.devmajor, extra.devminor = f"{key}/null", tarfile.CHRTYPE, 1, 3
        elif change == "fifo":
            extra.name, extra.type = f"{key}/pipe", tarfile.FIFOTYPE
        elif change == "unlisted":
            extra.name, extra.size = f"{key}/inductor/extra.py", 4
        elif change == "second-entry":
            extra.name, extra.size = "0000000000000000/index.json", 4
        else:
            return
        dst.addfile(extra, io.BytesIO(b"evil") if extra.size else None)


@pytest.mark.parametrize("change, said", [
    ("traversal", "absolute or escaping path"), ("absolute", "absolute or escaping path"),
    ("symlink", "is a link, not a regular file"), ("hardlink", "is a link, not a regular file"),
    ("device", "is a device or special file"), ("fifo", "is a device or special file"),
    ("unlisted", "is not listed in its index.json"), ("second-entry", "holds 2 entries"),
    ("checksum", "does not match its checksum"),
])
def test_a_hostile_archive_is_refused_before_anything_is_written(cache, tmp_path, capsys, change, said):
    root, key = cache
    good, bad = tmp_path / "good.tar", tmp_path / "bad.tar"
    assert run(capsys, "export", key, "-o", str(good), "--compile-cache", str(root))[0] == 0
    _hostile(good, bad, key, change)
    target = tmp_path / "target"
    status, _, err = run(capsys, "import", str(bad), "--compile-cache", str(target))
    assert status == 1 and said in err and err.count("\n") == 1, err
    assert not target.exists() and not (tmp_path / "evil.py").exists()
    # Into a folder holding a good entry: it is left exactly as it was.
    before = tree(root)
    status, _, err = run(capsys, "import", str(bad), "--compile-cache", str(root))
    assert status == 1 and tree(root) == before


def test_import_replaces_a_damaged_entry_and_sets_it_aside(cache, tmp_path, capsys):
    root, key = cache
    archive = tmp_path / "entry.tar"
    assert run(capsys, "export", key, "-o", str(archive), "--compile-cache", str(root))[0] == 0
    victim = sorted((root / key / "artifacts").glob("*.bin"))[0]
    flip(victim)
    status, text, _ = run(capsys, "import", str(archive), "--compile-cache", str(root))
    assert status == 0 and "a damaged or unfinished entry was set aside" in text
    assert run(capsys, "verify", "--compile-cache", str(root))[0] == 0
    aside = next(root.glob(f"{key}.broken-*"))  # the damaged entry, kept for inspection
    assert (aside / "artifacts" / victim.name).read_bytes() != victim.read_bytes()


# ---- the prune policy ------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100), st.booleans()), min_size=0, max_size=8),
       st.one_of(st.none(), st.integers(0, 400)), st.one_of(st.none(), st.integers(0, 9)),
       st.one_of(st.none(), st.integers(0, 10)))
def test_prune_chooses_least_recently_used_first_and_never_an_entry_in_use(spec, max_size, keep_last, older_than):
    from compiled_llm.entrypoints.cache_cli import Candidate, choose_removals

    now = 1000.0
    # Entry i was last used i hours ago (distinct times): index order is most recent first.
    candidates = [Candidate(CompileCache("/nonexistent", f"{i:016x}", {}), size, now - i * 3600, in_use)
                  for i, (size, in_use) in enumerate(spec)]
    chosen = choose_removals(candidates, older_than and older_than * 3600.0, max_size, keep_last, now)
    ids = {id(c) for c in chosen}
    kept = [c for c in candidates if id(c) not in ids]
    assert len(ids) == len(chosen) and not any(c.in_use for c in chosen)
    free = [c for c in candidates if not c.in_use]
    for i, c in enumerate(candidates):
        if c.in_use:
            continue
        if keep_last is not None and i >= keep_last:
            assert id(c) in ids
        if older_than is not None and now - c.last_used > older_than * 3600:
            assert id(c) in ids
    if max_size is not None:
        total = sum(c.size for c in kept)
        assert total <= max_size or all(id(c) in ids for c in free)
    if keep_last is None and older_than is None and max_size is not None and chosen:
        # Least recently used first, and no more than needed.
        assert max(c.last_used for c in chosen) <= min((c.last_used for c in kept if not c.in_use), default=now)
        assert sum(c.size for c in kept) + min(chosen, key=lambda c: -c.last_used).size > max_size
    if keep_last is None and older_than is None and max_size is None:
        assert chosen == []


def test_durations_and_sizes_parse_as_documented():
    from compiled_llm.entrypoints.cache_cli import parse_duration, parse_size

    assert [parse_duration(t) for t in ("7d", "12h", "30m", "90s", "2w", "1.5h")] == [
        604800, 43200, 1800, 90, 1209600, 5400]
    assert [parse_size(t) for t in ("2G", "500M", "1.5g", "800k", "1024", "2GiB", "3mb")] == [
        2 << 30, 500 << 20, 3 << 29, 800 << 10, 1024, 2 << 30, 3 << 20]
    for bad in ("7", "d", "-1d", "2X"):
        with pytest.raises(argparse.ArgumentTypeError):
            (parse_size if bad == "2X" else parse_duration)(bad)
