"""The on-disk compile cache: one folder per cache key, self-sufficient.

```
<root>/<key>/factors.json      why this entry exists (the hashed factors, readable)
<root>/<key>/about.json        what filled it: the model named and when (not hashed)
<root>/<key>/index.json        every other file of the entry -> its sha256 and size, and the key
<root>/<key>/manifest.sig      HMAC-SHA256 of index.json, with a signing key (optional)
<root>/<key>/graph.pkl, .json  the traced graph (traced_graph.py)
<root>/<key>/artifacts/*.bin   one Inductor artifact per (piece structure, shape range or size)
<root>/<key>/artifacts/*.code.json  its generated module, run by warm starts without Inductor (output_code.py)
<root>/<key>/weights/*         the model's weights as packed after loading (models/packed_weights.py)
<root>/<key>/inductor/         TORCHINDUCTOR_CACHE_DIR while a cold start fills this entry
<root>/<key>/triton/           TRITON_CACHE_DIR likewise
<root>/.<key>.lock             held while a process fills or reads the entry; its mtime: last used
```

What it promises:

- Nothing unverified is read. A warm start copies every file the index lists into a private
  folder, checking each against its checksum as it goes (and, with a signing key, the index
  against its signature first), and loads only from that copy: a file changed on disk is never
  unpickled or loaded, a file the index does not list is never seen, and a warm start writes
  nothing into the entry.
- A read-only entry (a read-only mount, a baked image, a folder without write permission) is
  served without the lock and without any write; only a complete entry can be.
- Writes are atomic (temp file, then rename) and only made under the lock, so concurrent starts
  never see half a file. A start that fails leaves no temp file, no file the index does not list,
  and no entry folder it created.
- A damaged file is set aside (moved to `<key>.broken-*`, never deleted) and only it is rebuilt.
- Every failure a user can fix is a `CompileCacheError` whose message is one line saying which.
- The cache can be inspected without loading anything (`entries`, `existing`, `verify`,
  `in_use`) and an entry removed only when no process holds it (`remove`): `compiled-llm cache`.

The trust model: a cache entry is code (pickled graphs, generated Python, shared libraries).
Checksums catch damage, not an attacker who can rewrite the index too; a signing key
(`--cache-signing-key-file`) makes only entries written with that key acceptable.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from compiled_llm.logger import init_logger
from compiled_llm.utils import UserError, atomic_write_bytes, user_cache_dir

logger = init_logger(__name__)

INDEX_FILE = "index.json"
SIGNATURE_FILE = "manifest.sig"
FACTORS_FILE = "factors.json"
ABOUT_FILE = "about.json"
# Packed weights: read by the loader (`read_verified`), not copied into a warm start's stage.
WEIGHTS_DIR = "weights"
KEY_LENGTH = 16
INDEX_VERSION = 2
SIGNATURE_SCHEME = "hmac-sha256"
# An OSError with one of these means the cache (or a temp folder) cannot be written.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}


class CompileCacheError(UserError, RuntimeError):
    """A compile cache problem the user can fix; the message is one line that says which."""


class CompileCacheMissError(CompileCacheError):
    """The cache cannot serve a start that must not compile: `require_cache_hit`, or a read-only
    cache. The message names the artifact (or file) that is missing or damaged, and why."""


class CompileCacheWriteError(CompileCacheError):
    """The cache cannot be written: a read-only or full disk, no permission, or a path that is not
    a folder."""


@dataclass(frozen=True)
class Damage:
    """A file of the entry that cannot be trusted. `whole_entry`: the index itself (nothing it
    lists can be trusted)."""

    path: str  # relative to the entry
    cause: str
    whole_entry: bool = False

    def __str__(self) -> str:
        return f"{self.path} {self.cause}"


@dataclass
class Stage:
    """A private copy of the verified files of an entry, where a warm start loads from."""

    folder: Path | None = None
    files: set[str] = field(default_factory=set)  # relative paths copied (each matched the index)
    damages: list[Damage] = field(default_factory=list)


class _ReadAhead:
    """One file being read and hashed in a thread (both release the GIL): its stat, bytes, SHA-256."""

    def __init__(self, path: Path) -> None:
        self.result: tuple[os.stat_result, bytes, str] | None = None
        self.thread = threading.Thread(target=self._read, args=(path,), name="CacheReadAhead", daemon=True)
        self.thread.start()

    def _read(self, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                stat, data = os.fstat(f.fileno()), f.read()
            self.result = (stat, data, hashlib.sha256(data).hexdigest())
        except OSError:  # gone, or unreadable: the read it was for reports that itself
            pass


_read_ahead: dict[str, _ReadAhead] = {}
_read_ahead_lock = threading.Lock()


def read_ahead(path: Path) -> None:
    """Start reading `path` and its checksum now, for a `read_verified` of it soon in this process,
    so that the two overlap the work between (a warm start's packed weights: 96 MB of the bundled
    model, 0.1-0.2 s of reading and SHA-256 on a 2-core machine, beside building the model). The
    bytes count only if they are what the index says, checked as any read's (else the file is read
    again); bytes nobody took are dropped by `drop_read_ahead`."""
    key = os.path.abspath(path)
    with _read_ahead_lock:
        if key not in _read_ahead:
            _read_ahead[key] = _ReadAhead(Path(key))


def take_read_ahead(path: Path) -> tuple[os.stat_result, bytes, str] | None:
    """The read-ahead of `path` (waiting for it to finish), once; None where there is none."""
    with _read_ahead_lock:
        ahead = _read_ahead.pop(os.path.abspath(path), None)
    if ahead is None:
        return None
    ahead.thread.join()
    return ahead.result


def drop_read_ahead() -> None:
    with _read_ahead_lock:
        _read_ahead.clear()


def default_cache_root() -> Path:
    return user_cache_dir() / "compile_cache"


def is_entry_name(name: str) -> bool:
    """A cache key: what names an entry folder (not a `.broken-*` folder, a lock or a stranger)."""
    return len(name) == KEY_LENGTH and all(c in "0123456789abcdef" for c in name)


def entries(root: str | Path) -> list[str]:
    """The keys of the entry folders under `root`, sorted."""
    try:
        return sorted(p.name for p in Path(root).expanduser().iterdir() if is_entry_name(p.name) and p.is_dir())
    except FileNotFoundError:
        return []


def read_json_file(path: Path) -> dict[str, Any] | None:
    """A JSON object from the entry, for display (not authenticated), or None."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_signing_key(path: str | Path) -> bytes:
    """The key in `path` (surrounding whitespace dropped). It is never logged or hashed into the
    cache key."""
    try:
        key = Path(path).expanduser().read_bytes().strip()
    except OSError as e:
        raise CompileCacheError(f"cannot read the cache signing key file {path}: {e.strerror}") from None
    if len(key) < 16:
        raise CompileCacheError(f"the cache signing key in {path} is too short: give at least 16 bytes")
    return key


def signature(key: bytes, index_bytes: bytes) -> str:
    return f"{SIGNATURE_SCHEME}:{hmac.new(key, index_bytes, hashlib.sha256).hexdigest()}\n"


def is_temp_file(name: str) -> bool:
    """Ours (atomic_write_bytes, InductorAdaptor.save) and Inductor's (codecache.write_atomic)."""
    return name.startswith(".") and name.endswith(".tmp")


def drop_isa_probes(inductor_dir: Path) -> int:
    """Remove Inductor's instruction-set probes from an entry's Inductor folder; how many files.

    Before it generates C++ for a CPU, Inductor dry-compiles a few lines per vector extension it
    may use (AVX-512 VNNI and BF16, AMX: `cpu_vec_isa.VecISA.check_build`, functions named
    `__*_chk_kernel`) into its cache folder, which while an entry fills is the entry's. They are
    no compiled code: a warm start never reads them and a process that compiles probes again. In
    the entry they were listed (and checksummed) as if they were kernels, on the CPUs that have
    such extensions only."""
    removed = 0
    if not inductor_dir.is_dir():
        return 0
    for source in inductor_dir.rglob("*.cpp"):
        try:
            if source.stat().st_size > 4096 or b"_chk_kernel" not in source.read_bytes():
                continue
        except OSError:
            continue
        for path in (source, source.with_suffix(".so")):
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def write_error(exc: BaseException) -> OSError | None:
    """The OSError that says a write failed, anywhere in `exc`'s chain (Dynamo and Inductor wrap
    errors raised inside a backend), or one made from the text of a tool's error (the C++
    compiler's "No space left on device")."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
            return exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        if any(os.strerror(code) in str(e) for e in chain):
            return OSError(code, os.strerror(code))
    return None


def _writable(path: Path) -> bool:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


STAGE_PREFIX = "compiled-llm-stage-"


def _remove_stage(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _remove_dead_stages() -> None:
    """Stages of processes that died without cleaning up (killed, or `os._exit`)."""
    temp = Path(tempfile.gettempdir())
    for path in temp.glob(f"{STAGE_PREFIX}*"):
        pid = path.name[len(STAGE_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _remove_stage(str(path))
        except OSError:
            pass  # alive, someone else's


class CompileCache:
    def __init__(
        self, root: str | Path | None, key: str, factors: dict[str, Any], signing_key: bytes | None = None,
        about: dict[str, Any] | None = None,
    ) -> None:
        self.root = Path(root).expanduser() if root else default_cache_root()
        self.key = key
        self.factors = factors
        self.about = about or {}  # written beside the factors, not hashed: the model's name
        self.entry = self.root / key
        self.signing_key = signing_key
        self.read_only = False  # set by `opened`
        self.writable = False  # holds the lock and may write (set by `opened`)
        self.index: dict[str, dict[str, Any]] = {}
        self._index_loaded = False
        # Files checked against the index (or written) by this start -> (size, mtime) when checked.
        self._verified: dict[str, tuple[int, int]] = {}
        self._wrote = False  # this start changed the entry
        self._stage: Stage | None = None

    @property
    def lock_path(self) -> Path:
        return self.root / f".{self.key}.lock"

    @staticmethod
    def artifact_rel(name: str) -> str:
        return f"artifacts/{name}.bin"

    # ---- one start --------------------------------------------------------------------------------
    @contextmanager
    def opened(self, require_cache_hit: bool = False) -> Iterator[None]:
        """Hold the entry for one start. A read-only cache is only read: no lock, no writes. A
        strict start finding no entry takes no lock either: it can only fail, and must leave
        nothing behind. Otherwise the lock is held throughout, stale temp files are removed first,
        and if the start fails, whatever it wrote that the index does not list is removed (the
        entry too, if this start created it and a write failed). A failed write (a full or
        read-only disk) is raised as a one-line `CompileCacheWriteError`."""
        self._check_root()
        self.read_only = self._detect_read_only()
        if self.read_only or (require_cache_hit and not self.entry.is_dir()):
            if self.read_only:
                logger.info("Compile cache %s is read-only: loading without a lock, writing nothing.", self.entry)
            try:
                yield
            except Exception as e:
                error = self._as_write_error(e)
                if error is None:
                    raise
                raise error from None
            return
        root_existed = self.root.is_dir()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CompileCacheWriteError(f"cannot create the compile cache folder {self.root}: {e.strerror}") from None
        lock_existed = self.lock_path.exists()
        error: CompileCacheWriteError | None = None
        remove_lock = False
        with self._locked() as lock:
            entry_existed = self.entry.is_dir()  # under the lock: no other start is creating it
            self.writable, self._wrote = True, False
            try:
                self._remove_temp_files()
                yield
                self.mark_used(lock)
            except BaseException as e:
                error = self._as_write_error(e)  # before the clean-up frees the disk
                emptied = self._undo_partial_writes(created_entry=not entry_existed, failed_write=error is not None)
                remove_lock = emptied and not entry_existed and not lock_existed
                if error is None:
                    raise
            finally:
                self.writable = False
                if remove_lock:
                    lock.unlink()
        if remove_lock and not root_existed:
            try:
                self.root.rmdir()  # only if this start created it and left it empty
            except OSError:
                pass
        if error is not None:
            raise error from None

    def _as_write_error(self, e: BaseException) -> CompileCacheWriteError | None:
        if isinstance(e, CompileCacheError) or not isinstance(e, Exception):
            return None
        oserror = write_error(e)
        if oserror is None:
            return None
        where = str(oserror.filename or "")
        if not where or where.startswith(str(self.root)):
            return CompileCacheWriteError(
                f"cannot write the compile cache entry {self.entry}: {oserror.strerror}"
                + (f" ({where})" if where else "")
            )
        return CompileCacheWriteError(f"compiling failed on {where}: {oserror.strerror}")

    def _check_root(self) -> None:
        """The root, or its nearest existing parent, must be a folder."""
        path = self.root
        while not path.exists() and path != path.parent:
            path = path.parent
        if not path.is_dir():
            raise CompileCacheWriteError(
                f"cannot use {self.root} as the compile cache folder: {path} is not a folder"
            )

    def _detect_read_only(self) -> bool:
        """The entry (or, with no entry, the folder it would be created in) cannot be written."""
        if self.entry.is_dir():
            return not (_writable(self.entry) and _writable(self.root))
        path = self.root
        while not path.exists() and path != path.parent:
            path = path.parent
        return not _writable(path)

    @contextmanager
    def _locked(self, wait: bool = True) -> Iterator[Path | None]:
        """Hold the lock file beside the entry (not in it: a broken entry is renamed away under the
        lock). A holder may remove the file, so a waiter checks it locked the file still there.
        `wait=False`: yield None at once if another process holds it."""
        while True:
            try:
                fd = self._open_lock()
            except OSError as e:
                raise CompileCacheWriteError(
                    f"cannot create the compile cache lock {self.lock_path}: {e.strerror}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                yield None
                return
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock_path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            yield self.lock_path
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    locked = _locked  # for tools that change an entry from outside a start (cache_archive's import)

    @staticmethod
    def mark_used(lock: Path) -> None:
        """Last used goes in the lock file's mtime: a warm start writes nothing in the entry."""
        try:
            os.utime(lock)
        except OSError:
            pass  # another user's lock file

    def in_use(self) -> bool:
        """Another process holds the entry (it is filling or loading it)."""
        if not self.lock_path.exists():
            return False
        with self._locked(wait=False) as lock:
            return lock is None

    def remove(self) -> bool:
        """Delete the entry and its lock file, unless another process holds it (then False). The
        folder is renamed away first, so that no start ever sees half of it."""
        with self._locked(wait=False) as lock:
            if lock is None:
                return False
            if self.entry.is_dir():
                doomed = self.root / f".{self.key}.removing-{os.getpid()}"
                os.replace(self.entry, doomed)
                shutil.rmtree(doomed)
            lock.unlink(missing_ok=True)  # a waiter that locked it notices and opens a new one
        return True

    def _open_lock(self) -> int:
        try:
            return os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:
            return os.open(self.lock_path, os.O_RDONLY)  # another user's lock file: flock needs no write

    def _remove_temp_files(self) -> None:
        for path in self._walk(self.entry):
            if is_temp_file(path.name):
                path.unlink(missing_ok=True)
                logger.info("Removed a stale temp file from the compile cache: %s", path)

    def _undo_partial_writes(self, created_entry: bool, failed_write: bool) -> bool:
        """After a failed start: remove the temp files and the files that this start wrote and the
        index on disk does not list; the whole entry if this start created it and a write failed
        (a full disk) or nothing in it got listed. True if there is no entry left."""
        if not self.entry.is_dir():
            return True
        if not self._wrote:
            return False
        listed = self._listed_on_disk()
        if created_entry and (failed_write or not listed):
            shutil.rmtree(self.entry, ignore_errors=True)
            return not self.entry.exists()
        for path in self._walk(self.entry):
            rel = path.relative_to(self.entry).as_posix()
            unlisted = listed is not None and rel not in listed and rel not in (INDEX_FILE, SIGNATURE_FILE)
            if is_temp_file(path.name) or unlisted:
                path.unlink(missing_ok=True)
        return False

    def _listed_on_disk(self) -> dict[str, Any] | None:
        """What index.json lists (not authenticated: used only to decide what to remove)."""
        try:
            files = json.loads((self.entry / INDEX_FILE).read_bytes()).get("files")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError):
            return None
        return files if isinstance(files, dict) else None

    @staticmethod
    def _walk(folder: Path) -> Iterator[Path]:
        for dirpath, _, filenames in os.walk(folder):
            for name in filenames:
                yield Path(dirpath) / name

    # ---- the index ----------------------------------------------------------------------------
    def _read_index_file(self) -> tuple[dict[str, dict[str, Any]], Damage | None]:
        """The files the index lists, or the reason it cannot be trusted (a whole-entry damage)."""
        path = self.entry / INDEX_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}, None
        except OSError as e:
            return {}, Damage(INDEX_FILE, f"is unreadable ({e.strerror})", whole_entry=True)
        if self.signing_key is not None:
            try:
                sig = (self.entry / SIGNATURE_FILE).read_bytes()
            except OSError:
                return {}, Damage(INDEX_FILE, "is not signed (no manifest.sig) and a cache signing key is given",
                                  whole_entry=True)
            if not hmac.compare_digest(sig.strip(), signature(self.signing_key, raw).encode().strip()):
                return {}, Damage(INDEX_FILE, "does not match its signature in manifest.sig (changed, or signed with "
                                              "another key)", whole_entry=True)
        try:
            data = json.loads(raw)
            version, key, files = data.get("version"), data.get("key"), data.get("files")
        except (ValueError, AttributeError) as e:
            return {}, Damage(INDEX_FILE, f"is unreadable ({type(e).__name__})", whole_entry=True)
        if version != INDEX_VERSION or key != self.key or not isinstance(files, dict):
            why = f"is not a version {INDEX_VERSION} index for key {self.key}"
            return {}, Damage(INDEX_FILE, why, whole_entry=True)
        return files, None

    def load_index(self) -> Damage | None:
        """Read (and with a signing key, authenticate) the index before trusting any file."""
        self.index, damage = self._read_index_file()
        self._index_loaded = True
        self._verified.clear()
        return damage

    def has(self, rel: str) -> bool:
        return rel in self.index

    def commit(self) -> None:
        """List every file of the entry in the index (hashing the files that are new or changed
        since they were checked) and write it, signed with the signing key if there is one."""
        assert self.writable, "the compile cache is written only under its lock"
        self._wrote = True
        drop_isa_probes(self.entry / "inductor")
        files = {}
        for path in sorted(self._walk(self.entry)):
            rel = path.relative_to(self.entry).as_posix()
            if rel in (INDEX_FILE, SIGNATURE_FILE) or is_temp_file(path.name):
                continue
            record = self.index.get(rel)
            stat = path.stat()
            if record is None or self._verified.get(rel) != (stat.st_size, stat.st_mtime_ns):
                record = {"sha256": file_sha256(path), "bytes": stat.st_size}
            files[rel] = record
            self._verified[rel] = (stat.st_size, stat.st_mtime_ns)
        self.index = files
        self._write_index()

    def _write_index(self) -> None:
        self._wrote = True
        payload = {"version": INDEX_VERSION, "key": self.key, "files": self.index}
        raw = json.dumps(payload, indent=1, sort_keys=True).encode()
        atomic_write_bytes(self.entry / INDEX_FILE, raw)
        if self.signing_key is not None:
            atomic_write_bytes(self.entry / SIGNATURE_FILE, signature(self.signing_key, raw).encode())
        else:
            (self.entry / SIGNATURE_FILE).unlink(missing_ok=True)  # it would no longer match

    # ---- reading -------------------------------------------------------------------------------
    def _read_verified(self, rel: str) -> tuple[bytes | None, Damage | None]:
        record = self.index[rel]
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not isinstance(record, dict):
            return None, Damage(INDEX_FILE, f"lists {rel!r} in a way no index written here does", whole_entry=True)
        path = self.entry / rel
        ahead = take_read_ahead(path)
        if ahead is not None:  # read (and hashed) ahead: used if it is the file the index describes
            stat, data, digest = ahead
            if len(data) == record.get("bytes") and digest == record.get("sha256"):
                self._verified[rel] = (stat.st_size, stat.st_mtime_ns)
                return data, None
        try:
            stat = path.stat()
            data = path.read_bytes()
        except FileNotFoundError:
            return None, Damage(rel, "is missing (listed in the index)")
        except OSError as e:
            return None, Damage(rel, f"is unreadable ({e.strerror})")
        if len(data) != record.get("bytes"):
            return None, Damage(rel, f"does not match its checksum ({len(data)} bytes where the index says "
                                     f"{record.get('bytes')}: truncated or overwritten)")
        if hashlib.sha256(data).hexdigest() != record.get("sha256"):
            return None, Damage(rel, "does not match its checksum (changed since it was written)")
        self._verified[rel] = (stat.st_size, stat.st_mtime_ns)
        return data, None

    def read_verified(self, rel: str) -> bytes | None:
        """The bytes of file `rel` of the entry, checked against the index (and its signature), or
        None where the entry does not list it or cannot vouch for it (the damage is logged)."""
        if not self._index_loaded:
            damage = self.load_index()
            if damage is not None:
                logger.warning("Compile cache entry %s: %s; not reading %s.", self.entry, damage, rel)
                return None
        if rel not in self.index:
            return None
        data, damage = self._read_verified(rel)
        if damage is not None:
            logger.warning("Compile cache file %s %s; not reading it.", self.entry / damage.path, damage.cause)
        return data

    def stage(self) -> Stage:
        """Copy every file the index lists into a private folder, each checked against the index
        (and read once: what is checked is what is loaded). No files: nothing is saved. A stage
        with `damages` must not be loaded from."""
        if not self.entry.is_dir():
            self.index, self._index_loaded = {}, True
            return Stage()
        damage = self.load_index()
        if damage is not None:
            return Stage(damages=[damage])
        if not self.index:
            return Stage()
        if self._stage is None:
            _remove_dead_stages()
            folder = tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-")
            weakref.finalize(self, _remove_stage, folder)
            self._stage = Stage(Path(folder))
        stage = self._stage
        stage.files.clear()
        stage.damages.clear()
        for rel in sorted(self.index):
            if rel.startswith(f"{WEIGHTS_DIR}/"):
                continue
            data, damage = self._read_verified(rel)
            if damage is not None:
                stage.damages.append(damage)
                continue
            dest = stage.folder / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            stage.files.add(rel)
        return stage

    @property
    def staged_folder(self) -> Path | None:
        """The private copy a warm start loaded from, if any."""
        return self._stage.folder if self._stage is not None else None

    def use_stage_for_inductor(self) -> None:
        """Point Inductor's and Triton's own caches at the private copy (a warm load writes there)."""
        assert self._stage is not None
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self._stage.folder / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(self._stage.folder / "triton")

    # ---- inspecting (nothing is loaded) ----------------------------------------------------------
    def verify(self, checksums: bool = True) -> list[Damage]:
        """Check the index (and with a signing key, its signature) and every file it lists against
        its checksum (`checksums=False`: its size only, which reads no file), without loading or
        copying anything. Files the index does not list (other
        than temp files) are reported too: a start never reads them, but nothing vouches for them.
        An empty list: the entry is whole (it may still be unfinished: see `complete`)."""
        if not self.entry.is_dir():
            return [Damage(".", "is missing (no entry folder)", whole_entry=True)]
        if not (self.entry / INDEX_FILE).exists():
            return [Damage(INDEX_FILE, "is missing: the entry is unfinished (a start was interrupted, or is "
                                       "filling it now)", whole_entry=True)]
        index, damage = self._read_index_file()
        if damage is not None:
            return [damage]
        damages = []
        for rel in sorted(index):
            record = index[rel]
            if Path(rel).is_absolute() or ".." in Path(rel).parts or not isinstance(record, dict):
                return [Damage(INDEX_FILE, f"lists {rel!r} in a way no index written here does", whole_entry=True)]
            path = self.entry / rel
            if path.is_symlink() or (path.exists() and not path.is_file()):
                damages.append(Damage(rel, "is not a plain file"))
                continue
            try:
                size = path.stat().st_size
                digest = file_sha256(path) if checksums and size == record.get("bytes") else None
            except FileNotFoundError:
                damages.append(Damage(rel, "is missing (listed in the index)"))
                continue
            except OSError as e:
                damages.append(Damage(rel, f"is unreadable ({e.strerror})"))
                continue
            if size != record.get("bytes"):
                damages.append(Damage(rel, f"does not match its checksum ({size} bytes where the index says "
                                           f"{record.get('bytes')}: truncated or overwritten)"))
            elif checksums and digest != record.get("sha256"):
                damages.append(Damage(rel, "does not match its checksum (changed since it was written)"))
        for path in sorted(self._walk(self.entry)):
            rel = path.relative_to(self.entry).as_posix()
            if rel not in index and rel not in (INDEX_FILE, SIGNATURE_FILE) and not is_temp_file(path.name):
                damages.append(Damage(rel, "is not listed in the index (a foreign file: never loaded, removed by "
                                           "the next start that compiles)"))
        return damages

    def listed(self) -> dict[str, dict[str, Any]]:
        """What the index on disk lists (not authenticated: for display and sizes)."""
        return self._listed_on_disk() or {}

    @property
    def signed(self) -> bool:
        return (self.entry / SIGNATURE_FILE).is_file()

    @property
    def complete(self) -> bool:
        """A start finished filling it: the traced graph, saved last, is listed."""
        return "graph.pkl" in self.listed()

    @property
    def last_used(self) -> float | None:
        """When a start last held it (the lock file's mtime), else when it was last written."""
        for path in (self.lock_path, self.entry / INDEX_FILE, self.entry):
            try:
                return path.stat().st_mtime
            except OSError:
                continue
        return None

    @property
    def created(self) -> float | None:
        for path in (self.entry / FACTORS_FILE, self.entry):
            try:
                return path.stat().st_mtime
            except OSError:
                continue
        return None

    def size(self) -> int:
        return sum(p.stat().st_size for p in self._walk(self.entry) if not p.is_symlink())

    @classmethod
    def existing(cls, root: str | Path | None, key: str, signing_key: bytes | None = None) -> CompileCache:
        """An entry found on disk, with the factors and `about` it stored (unauthenticated, for
        display: a start recomputes its own factors)."""
        cache = cls(root, key, {}, signing_key)
        cache.factors = read_json_file(cache.entry / FACTORS_FILE) or {}
        cache.about = read_json_file(cache.entry / ABOUT_FILE) or {}
        return cache

    # ---- writing -------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Before compiling into the entry: create it, drop every file the index does not list
        (leftovers of an interrupted start, or files nobody vouches for: Inductor would read
        them), and point Inductor's and Triton's own caches into it."""
        assert self.writable, "the compile cache is written only under its lock"
        self._wrote = True
        if not self._index_loaded:
            damage = self.load_index()
            if damage is not None:
                self.set_aside([damage])
        damages = [d for rel in sorted(self.index) if rel not in self._verified
                   for d in [self._read_verified(rel)[1]] if d is not None]
        if damages:
            self.set_aside(damages)
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        unlisted = [path for path in self._walk(self.entry)
                    if path.relative_to(self.entry).as_posix() not in (*self.index, INDEX_FILE, SIGNATURE_FILE)]
        for path in unlisted:
            path.unlink(missing_ok=True)
        if unlisted:
            logger.info("Removed %d file(s) the compile cache index does not list from %s.", len(unlisted), self.entry)
        self._write_descriptions()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.entry / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(self.entry / "triton")
        # Inductor keeps the kernels it built in memory, keyed by their source: compiling the same
        # kernels again for this entry would take them from there and write no shared library here,
        # and every warm start from the entry would then rebuild them (12 s of C++ compiles on a
        # 2-core machine). Models already compiled keep the libraries they hold.
        from torch._inductor.utils import clear_caches

        clear_caches()

    def _write_descriptions(self) -> None:
        if not (self.entry / FACTORS_FILE).exists():
            atomic_write_bytes(self.entry / FACTORS_FILE,
                               json.dumps(self.factors, indent=2, sort_keys=True, default=repr).encode())
        if self.about and not (self.entry / ABOUT_FILE).exists():
            about = {**self.about, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            atomic_write_bytes(self.entry / ABOUT_FILE, json.dumps(about, indent=2, sort_keys=True).encode())

    def replace_file(self, rel: str, data: bytes) -> bool:
        """Write `data` as file `rel` of the entry and list it in the index (checksummed and signed
        like the compiled files), removing the other files of its folder (one file a folder: the
        packed weights of the checkpoint last loaded). The index is read again under the lock, so
        what another start listed meanwhile stays listed. False, writing nothing, where the index on
        disk cannot be trusted: the next start that compiles sets the entry aside first."""
        assert self.writable, "the compile cache is written only under its lock"
        if self.load_index() is not None:
            return False
        self._wrote = True
        self.entry.mkdir(parents=True, exist_ok=True)
        self._write_descriptions()
        folder = Path(rel).parent.as_posix()
        for old in [r for r in self.index if Path(r).parent.as_posix() == folder and r != rel]:
            (self.entry / old).unlink(missing_ok=True)
            self.index.pop(old)
            self._verified.pop(old, None)
        atomic_write_bytes(self.entry / rel, data)
        for name in (FACTORS_FILE, ABOUT_FILE, rel):  # the descriptions too, as `commit` lists them
            path = self.entry / name
            if path.is_file() and (name == rel or name not in self.index):
                stat = path.stat()
                self.index[name] = {"sha256": file_sha256(path), "bytes": stat.st_size}
                self._verified[name] = (stat.st_size, stat.st_mtime_ns)
        self._write_index()
        return True

    @property
    def artifacts_dir(self) -> Path:
        return self.entry / "artifacts"

    def set_aside(self, damages: list[Damage]) -> Path:
        """Move damaged files (or the whole entry, if its index cannot be trusted) out of the way,
        kept for inspection, and drop them from the index."""
        assert self.writable, "the compile cache is written only under its lock"
        self._wrote = True
        aside = self.root / f"{self.key}.broken-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        if any(d.whole_entry for d in damages):
            reason = next(d for d in damages if d.whole_entry)
            os.replace(self.entry, aside)
            logger.warning("Compile cache entry %s cannot be trusted (%s); moved it to %s and rebuilding it.",
                           self.entry, reason, aside)
            self.index, self._index_loaded = {}, True
            self._verified.clear()
            return aside
        for d in damages:
            source = self.entry / d.path
            if source.exists():
                (aside / d.path).parent.mkdir(parents=True, exist_ok=True)
                os.replace(source, aside / d.path)
            self.index.pop(d.path, None)
            self._verified.pop(d.path, None)
            logger.warning("Compile cache file %s %s; moved it to %s and rebuilding it.",
                           self.entry / d.path, d.cause, aside / d.path)
        self._write_index()
        return aside
