"""The compile cache on bad disks and from untrusted stores (issue 10, items 7-10).

Starts run in fresh subprocesses (the toy model, or `compiled-llm precompile` on a tiny Llama),
with the cache key pinned for the toy so that edits to the package between two starts do not
move the entry. Read-only caches are real: the files lose their write bits, and a root test
process drops CAP_DAC_OVERRIDE in the child, so that root too is refused a write (CI runs as root).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_llm.compilation import compile_cache, traced_graph
from compiled_llm.compilation.cache_key import cache_key
from compiled_llm.compilation.compile_cache import CompileCacheMissError
from compiled_llm.compilation.counters import counters
from compiled_llm.compilation.inductor_adaptor import InductorAdaptor
from tests.compilation.toy_compile import compile_toy, toy_config, toy_factors
from tests.compilation.toy_model import ToyModel

REPO = Path(__file__).resolve().parents[2]
KEY = "00hardening00key"  # the toy's pinned cache key
SECRET = b"a signing key for the tests, 0123456789"
TINY_FLAGS = ["--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "8"]
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE = 24, 1


# ---- helpers ------------------------------------------------------------------------------------
def _no_write_override() -> None:
    """In the child, before exec: root loses the right to write where the mode bits say no."""
    if os.geteuid() == 0:
        ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0)


@pytest.fixture(scope="session")
def unwritable():
    """A function making a folder tree read-only for child processes (undone at teardown)."""
    made = []

    def make(root: Path) -> None:
        for path in [root, *root.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        made.append(root)

    probe = Path(tempfile.mkdtemp())
    make(probe)
    out = subprocess.run([sys.executable, "-c", f"open({str(probe / 'x')!r}, 'w')"], preexec_fn=_no_write_override,
                         capture_output=True)
    if out.returncode == 0:
        pytest.skip("cannot make a folder unwritable for a child process here")
    yield make
    for root in made:
        for path in [root, *root.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
        if root == probe:
            shutil.rmtree(root)


def toy(cache: Path, strict: bool = False, read_only: bool = False, wrapper: list[str] = (), **options):
    """A start of the toy model in a fresh process: (its counters and max error, or its error; its log)."""
    cmd = [*wrapper, sys.executable, "-m", "tests.compilation.toy_compile", str(cache), "null", "[]",
           "1" if strict else "0", json.dumps({"key": KEY, **options})]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "COMPILED_LLM_LOG_LEVEL": "INFO"},
                         preexec_fn=_no_write_override if read_only else None)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def precompile(model: str, cache: Path | str, *extra: str, preexec=None, wrapper: list[str] = ()):
    return subprocess.run([*wrapper, "compiled-llm", "precompile", model, "--compile-cache", str(cache), "--json",
                           *TINY_FLAGS, *extra], capture_output=True, text=True, timeout=900, preexec_fn=preexec)


def one_error_line(stderr: str) -> str:
    """The CLI's error, which must be its only one, with no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def tree(root: Path, lock: bool = True) -> dict[str, tuple[int, int, str]]:
    """Every file and folder under `root` (the lock file too, if `lock`): size, mtime and content hash."""
    state = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if not lock and rel == f".{KEY}.lock":
            continue
        if path.is_dir():
            state[rel] = (0, path.stat().st_mtime_ns, "dir")
        else:
            state[rel] = (path.stat().st_size, path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return state


def flip(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def index_of(entry: Path) -> dict[str, dict]:
    return json.loads((entry / "index.json").read_text())["files"]


def can_mount() -> bool:
    return subprocess.run(["unshare", "--mount", "--map-root-user", "mount", "-t", "tmpfs", "tmpfs", "/mnt"],
                          capture_output=True).returncode == 0 if shutil.which("unshare") else False


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Path:
    """A cache root holding one complete, unsigned toy entry (copy it before changing it)."""
    root = tmp_path_factory.mktemp("filled")
    cold, _ = toy(root)
    assert cold["num_inductor_compilations"] == 3 and cold["cache_entry"] == str(root / KEY)
    (root / f".{KEY}.lock").unlink()
    return root


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "cache.key"
    path.write_bytes(SECRET + b"\n")
    return path


def copy_of(root: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a copy of the cache root, its entry)."""
    dest = tmp_path / "cache"
    shutil.copytree(root, dest, symlinks=True)
    return dest, dest / KEY


@pytest.fixture(scope="module")
def resigned(tmp_path_factory, filled, key_file) -> tuple[Path, dict, dict, str]:
    """(the cache root, the refused strict start, the rebuilding start, its log): a copy of the unsigned
    `filled` started with `key_file`, strictly (refused), then normally (every piece compiled again
    and the new entry signed)."""
    root, _ = copy_of(filled, tmp_path_factory.mktemp("resigned"))
    refused, _ = toy(root, strict=True, signing_key_file=str(key_file))
    rebuilt, log = toy(root, signing_key_file=str(key_file))
    return root, refused, rebuilt, log


@pytest.fixture(scope="module")
def signed(resigned) -> Path:
    """A cache root holding one complete toy entry signed with `key_file`: the one `resigned` rebuilt,
    a cold compile with the key (next to it, the unsigned entry it set aside)."""
    root, _, rebuilt, log = resigned
    assert rebuilt["num_inductor_compilations"] == 3 and "Signed compile cache entry" in log
    return root


# ---- 7: a read-only cache can be served ---------------------------------------------------------
@pytest.mark.parametrize("strict", [True, False])
def test_a_read_only_cache_is_served_without_a_lock_or_any_write(filled, tmp_path, unwritable, strict):
    root, entry = copy_of(filled, tmp_path)
    before = tree(root)
    unwritable(root)
    warm, log = toy(root, strict=strict, read_only=True)
    assert "error" not in warm, warm
    assert warm["num_inductor_compilations"] == 0 and warm["num_graphs_traced"] == 0
    assert warm["num_artifacts_loaded"] == 3 and warm["max_error"] < 1e-5
    assert "read-only" in log
    assert tree(root) == before  # no lock file, no temp file, nothing rewritten


def test_a_read_only_mount_is_served(filled, tmp_path):
    if not can_mount():
        pytest.skip("no mount namespaces here")
    root, _ = copy_of(filled, tmp_path)
    before = tree(root)
    ro_mount = ["unshare", "--mount", "--map-root-user", "sh", "-c",
                f'mount --bind "{root}" "{root}" && mount -o remount,bind,ro "{root}" && exec "$@"', "sh"]
    warm, log = toy(root, strict=True, wrapper=ro_mount)
    assert "error" not in warm, warm
    assert warm["num_inductor_compilations"] == 0 and warm["max_error"] < 1e-5 and "read-only" in log
    assert tree(root) == before


def test_precompile_into_a_read_only_folder_is_one_line_and_writes_nothing(tiny_llama, tmp_path, unwritable):
    root = tmp_path / "cache"
    root.mkdir()
    unwritable(root)
    out = precompile(tiny_llama, root, preexec=_no_write_override)
    assert out.returncode == 1
    assert "read-only" in one_error_line(out.stderr)
    assert list(root.iterdir()) == []


# ---- 8: bad disks give one line and leave nothing -----------------------------------------------
def _small_files_only() -> None:
    """Writes past 4 KiB fail (EFBIG) as they would on a full disk: Inductor's first source file."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_precompile_on_a_full_disk_is_one_line_and_leaves_nothing(tiny_llama, tmp_path):
    root = tmp_path / "cache"
    out = precompile(tiny_llama, root, preexec=_small_files_only)
    assert out.returncode == 1
    line = one_error_line(out.stderr)
    assert "cannot write the compile cache entry" in line and "File too large" in line
    assert not root.exists() or not [p for p in root.rglob("*") if p.is_file()]


def test_precompile_on_a_real_full_filesystem(tiny_llama, tmp_path):
    if not can_mount():
        pytest.skip("no mount namespaces here")
    root = tmp_path / "small"
    root.mkdir()
    script = (f'mount -t tmpfs -o size=700k tmpfs "{root}" && "$@"; echo "rc=$?"; '
              f'find "{root}" -mindepth 1 -printf "left: %P\\n"')
    out = precompile(tiny_llama, root, wrapper=["unshare", "--mount", "--map-root-user", "sh", "-c", script, "sh"])
    assert "rc=1" in out.stdout, out.stderr[-3000:]
    assert "No space left on device" in one_error_line(out.stderr)
    assert "left:" not in out.stdout  # no temp file, no half entry, no lock


def test_a_cache_path_under_a_file_is_one_line(tiny_llama, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    out = precompile(tiny_llama, tmp_path / "file" / "cache")
    assert out.returncode == 1
    assert "is not a folder" in one_error_line(out.stderr)


# ---- 9: the strict-start error names what failed; only that is set aside ------------------------
def test_strict_start_names_the_damaged_artifact_and_moves_nothing(filled, tmp_path):
    root, entry = copy_of(filled, tmp_path)
    victim = sorted((entry / "artifacts").glob("*.bin"))[1]
    flip(victim, 1000)
    before = tree(root)
    refused, _ = toy(root, strict=True)
    error = refused["error"]
    assert f"artifacts/{victim.name} does not match its checksum" in error and "missing" not in error
    assert tree(root, lock=False) == before  # nothing set aside, nothing written: a strict start only reads
    again, log = toy(root)  # a normal start sets aside and rebuilds that artifact alone
    assert again["num_inductor_compilations"] == 1 and again["max_error"] < 1e-5
    aside = next(tmp_path.glob(f"cache/{KEY}.broken-*"))
    assert [p.relative_to(aside).as_posix() for p in aside.rglob("*") if p.is_file()] == [f"artifacts/{victim.name}"]
    warm, _ = toy(root, strict=True)
    assert warm["num_inductor_compilations"] == 0 and warm["max_error"] < 1e-5


def test_strict_start_names_an_artifact_that_does_not_load_and_why(filled, tmp_path):
    root, entry = copy_of(filled, tmp_path)
    victim = sorted((entry / "artifacts").glob("*.bin"))[0]
    victim.write_bytes(b"not an artifact")
    index = json.loads((entry / "index.json").read_text())
    index["files"][f"artifacts/{victim.name}"] = {"sha256": hashlib.sha256(b"not an artifact").hexdigest(), "bytes": 15}
    # Its saved module, which a warm start runs instead of it, taken out (a saved module that does
    # not load: tests/compilation/test_output_code.py).
    saved_module = victim.with_name(victim.name.removesuffix(".bin") + ".code.json")
    saved_module.unlink()
    del index["files"][f"artifacts/{saved_module.name}"]
    (entry / "index.json").write_text(json.dumps(index))
    refused, _ = toy(root, strict=True)
    assert f"artifacts/{victim.name} does not load (" in refused["error"] and "missing" not in refused["error"]


def test_a_damaged_inductor_file_is_named_and_only_it_rebuilt(filled, tmp_path):
    root, entry = copy_of(filled, tmp_path)
    victim = sorted((entry / "inductor").rglob("*.so"))[0]
    rel = victim.relative_to(entry).as_posix()
    flip(victim, 4000)
    refused, _ = toy(root, strict=True)
    assert f"{rel} does not match its checksum" in refused["error"]
    again, _ = toy(root)
    assert again["num_inductor_compilations"] == 0 and again["num_graphs_traced"] == 1 and again["max_error"] < 1e-5
    aside = next(tmp_path.glob(f"cache/{KEY}.broken-*"))
    assert [p.relative_to(aside).as_posix() for p in aside.rglob("*") if p.is_file()] == [rel]
    assert victim.is_file() and rel in index_of(entry)  # rebuilt (the C++ code compiled again) and listed
    warm, _ = toy(root, strict=True)
    assert warm["num_graphs_traced"] == 0 and warm["num_inductor_compilations"] == 0


def test_a_refused_strict_start_leaves_nothing(tmp_path):
    refused, _ = toy(tmp_path, strict=True)
    assert "Compile cache miss" in refused["error"] and "-r1-32" in refused["error"]
    assert list(tmp_path.iterdir()) == []  # no entry folder, no lock file


def test_a_refused_strict_serve_is_one_line(tiny_llama, tmp_path):
    out = subprocess.run(["compiled-llm", "serve", tiny_llama, "--compile-cache", str(tmp_path / "cache"),
                          "--require-cache-hit", "--port", "0", *TINY_FLAGS],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1
    assert "Compile cache miss" in one_error_line(out.stderr)
    assert not (tmp_path / "cache").exists()


def test_stale_temp_files_are_removed_at_start(filled, tmp_path):
    root, entry = copy_of(filled, tmp_path)
    stale = [entry / ".index.json.k2j3h4.tmp", entry / "artifacts" / ".x-r1-32.bin.abcd.tmp",
             next((entry / "inductor").iterdir()) / ".1234.5678.tmp"]
    for path in stale:
        path.write_bytes(b"half written")
    warm, _ = toy(root, strict=True)
    assert warm["num_inductor_compilations"] == 0
    assert not [p for p in stale if p.exists()]


# ---- 10: trust ----------------------------------------------------------------------------------
def test_every_file_of_an_entry_is_in_the_index(filled):
    entry = filled / KEY
    files = {p.relative_to(entry).as_posix() for p in entry.rglob("*") if p.is_file()} - {"index.json"}
    index = index_of(entry)
    assert set(index) == files
    assert {"graph.pkl", "graph.json", "factors.json"} <= files and any(f.startswith("inductor/") for f in files)
    for rel, record in index.items():
        data = (entry / rel).read_bytes()
        assert record == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_inductor_instruction_set_probes_are_not_kept_in_an_entry(tmp_path):
    """Inductor's dry-compiled probes of a CPU's vector extensions (written into the entry's
    Inductor folder on CPUs with AVX-512 VNNI, BF16 or AMX) are no kernels: they are dropped, the
    kernels' sources and libraries kept."""
    inductor = tmp_path / "inductor"
    (inductor / "ab").mkdir(parents=True)
    (inductor / "cd").mkdir()
    probe = inductor / "ab" / "cabprobe.cpp"
    probe.write_text('#include <immintrin.h>\nextern "C" void __amx_chk_kernel() {}\n')
    probe.with_suffix(".so").write_bytes(b"\x7fELF probe")
    kernel = inductor / "cd" / "ccdkernel.main.cpp"
    kernel.write_text('extern "C" void kernel(const float* in_ptr0, float* out_ptr0) {}\n')
    kernel.with_suffix(".so").write_bytes(b"\x7fELF kernel")
    assert compile_cache.drop_isa_probes(inductor) == 2
    assert sorted(p.relative_to(inductor).as_posix() for p in inductor.rglob("*") if p.is_file()) == [
        "cd/ccdkernel.main.cpp", "cd/ccdkernel.main.so"]
    assert compile_cache.drop_isa_probes(tmp_path / "none") == 0


def test_entry_files_are_readable_by_the_serving_user(filled):
    """Written with the permissions the umask gives (a cache built as root in an image is served
    by another user), not mkstemp's owner-only ones."""
    umask = os.umask(0o022)
    os.umask(umask)
    entry = filled / KEY
    for name in ("factors.json", "index.json", "graph.pkl", "graph.json"):
        assert (entry / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")  # unpickling it creates the marker file


def test_a_changed_saved_graph_is_never_unpickled(filled, tmp_path):
    import pickle

    root, entry = copy_of(filled, tmp_path)
    marker = tmp_path / "unpickled"
    (entry / "graph.pkl").write_bytes(pickle.dumps(_Planted(str(marker))))
    again, log = toy(root)
    assert not marker.exists()
    assert again["num_graphs_traced"] == 1 and again["num_inductor_compilations"] == 0 and again["max_error"] < 1e-5
    assert "graph.pkl does not match its checksum" in log


def test_the_signing_key_is_not_in_the_cache_key_nor_written(signed, key_file, tmp_path):
    model = ToyModel()
    with_key = toy_config(str(tmp_path), signing_key_file=str(key_file))
    assert cache_key(toy_factors(with_key, model)) == cache_key(toy_factors(toy_config(str(tmp_path)), model))
    entry = signed / KEY
    assert (entry / "manifest.sig").read_text().startswith("hmac-sha256:")
    for path in entry.rglob("*"):
        assert not path.is_file() or SECRET not in path.read_bytes()
    warm, log = toy(signed, strict=True, signing_key_file=str(key_file))
    assert warm["num_inductor_compilations"] == 0 and warm["max_error"] < 1e-5
    assert SECRET.decode() not in log and str(key_file) not in log


def test_an_unsigned_entry_is_refused_with_a_key_and_rebuilt_signed_without_strict(resigned, key_file, tmp_path):
    root, refused, rebuilt, log = resigned
    assert "index.json is not signed" in refused["error"]
    assert rebuilt["num_inductor_compilations"] == 3 and "moved it to" in log
    warm, _ = toy(copy_of(root, tmp_path)[0], strict=True, signing_key_file=str(key_file))
    assert warm["num_inductor_compilations"] == 0


@pytest.fixture()
def loads(monkeypatch):
    """Records every unpickled graph and loaded artifact in this process."""
    seen = []
    load_graph, load_artifact = traced_graph.load_graph, InductorAdaptor.load
    monkeypatch.setattr(traced_graph, "load_graph", lambda folder: seen.append("graph") or load_graph(folder))
    monkeypatch.setattr(InductorAdaptor, "load", staticmethod(lambda path: seen.append(path) or load_artifact(path)))
    return seen


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(min_value=0), offset=st.integers(min_value=0))
def test_a_signed_entry_with_any_byte_changed_is_refused_before_loading(signed, key_file, loads, which, offset):
    with tempfile.TemporaryDirectory() as scratch:
        root, entry = copy_of(signed, Path(scratch))
        files = sorted(p for p in entry.rglob("*") if p.is_file() and p.stat().st_size)
        victim = files[which % len(files)]
        flip(victim, offset)
        rel = victim.relative_to(entry).as_posix()
        counters.reset()
        with pytest.raises(CompileCacheMissError) as info:
            compile_toy(str(root), strict=True, signing_key_file=str(key_file), key=KEY)
        named = "does not match its signature" if rel in ("index.json", "manifest.sig") else f"{rel} does not match"
        assert named in str(info.value)
        assert loads == [] and counters.num_artifacts_loaded == 0 and counters.num_graphs_traced == 0


def test_precompile_signs_and_serve_side_refuses_a_changed_entry(tiny_llama, key_file, tmp_path):
    signing = ["--cache-signing-key-file", str(key_file)]
    cold = precompile(tiny_llama, tmp_path, *signing)
    assert cold.returncode == 0, cold.stderr[-3000:]
    entry = Path(json.loads(cold.stdout.strip().splitlines()[-1])["cache_dir"])
    assert (entry / "manifest.sig").is_file()
    warm = precompile(tiny_llama, tmp_path, "--require-cache-hit", *signing)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert json.loads(warm.stdout.strip().splitlines()[-1])["inductor_compilations"] == 0
    victim = sorted((entry / "artifacts").glob("*.bin"))[0]
    flip(victim, 77)
    refused = precompile(tiny_llama, tmp_path, "--require-cache-hit", *signing)
    assert refused.returncode == 1
    assert f"artifacts/{victim.name} does not match its checksum" in one_error_line(refused.stderr)
    missing_key = precompile(tiny_llama, tmp_path, "--cache-signing-key-file", str(tmp_path / "nope"))
    assert missing_key.returncode == 1 and "signing key file" in one_error_line(missing_key.stderr)


# ---- issue 11: the warm load verifies each file once ---------------------------------------------
def test_a_warm_start_hashes_each_file_of_the_entry_once(filled, tmp_path, monkeypatch):
    root, entry = copy_of(filled, tmp_path)
    digests = []
    real = hashlib.sha256

    class Counting:
        def __init__(self, data: bytes = b"") -> None:
            self.h = real(data)

        def update(self, data: bytes) -> None:
            self.h.update(data)

        def hexdigest(self) -> str:
            digests.append(self.h.hexdigest())
            return digests[-1]

    monkeypatch.setattr(compile_cache, "hashlib", types.SimpleNamespace(sha256=Counting))
    counters.reset()
    _, compiled, snapshot = compile_toy(str(root), strict=True, key=KEY)
    assert snapshot["num_inductor_compilations"] == 0 and snapshot["num_graphs_traced"] == 0
    assert compiled.report.artifacts_loaded == 3 and compiled.report.pieces == 4
    expected = collections.Counter(r["sha256"] for r in index_of(entry).values())
    assert collections.Counter(digests) == expected  # every file once, the shared middle piece too
