"""One compile cache entry as one portable file: a tar that a CI stores and restores as one artifact.

```
<key>/index.json      the entry's index: every other member's sha256 and size, and the key
<key>/manifest.sig    its HMAC-SHA256 (when the entry is signed, or a signing key is given at export)
<key>/<path>          every file the index lists, nothing else
```

`export_entry` reads each file once, checks it against the index as it goes and refuses a damaged
entry. `import_entry` checks the whole archive before it writes anything: only regular files, no
absolute path, no `..`, one entry, every member listed in the index with the right size and
checksum, and with a signing key, the index's signature. Then it writes into a temp folder beside
the entry, checking again as it writes, and renames it into place under the entry's lock. A good
entry already there is kept; a damaged or unfinished one is set aside (`<key>.broken-*`).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import lzma
import os
import shutil
import tarfile
import time
import zlib
from pathlib import Path, PurePosixPath
from typing import IO

from compiled_llm.compilation.compile_cache import (
    INDEX_FILE,
    INDEX_VERSION,
    SIGNATURE_FILE,
    CompileCache,
    CompileCacheError,
    is_entry_name,
    signature,
)

CHUNK = 1 << 20
# What reading a truncated or corrupt archive raises (tarfile's own errors, a compressed stream's).
DAMAGED_ARCHIVE = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError)


def _write_mode(path: Path) -> str:
    return "w:gz" if path.name.endswith((".gz", ".tgz")) else "w"


def _member(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, int(mtime), 0o644, tarfile.REGTYPE
    return info


def export_entry(cache: CompileCache, out: str | Path) -> int:
    """Write `cache`'s entry to `out` (gzip if it ends in .gz or .tgz), signed with the cache's
    signing key if it has one. Returns the number of files. The file appears whole or not at all."""
    entry, key = cache.entry, cache.key
    try:
        raw = (entry / INDEX_FILE).read_bytes()
    except FileNotFoundError:
        raise CompileCacheError(f"cannot export {entry}: it has no index (no such entry, or an unfinished "
                                f"one)") from None
    existing_sig = (entry / SIGNATURE_FILE).read_bytes() if cache.signed else None
    if cache.signing_key is not None:
        sig = signature(cache.signing_key, raw).encode()
        if existing_sig is not None and not hmac.compare_digest(existing_sig.strip(), sig.strip()):
            raise CompileCacheError(f"cannot export {entry}: {INDEX_FILE} does not match its signature in "
                                    f"{SIGNATURE_FILE} (changed, or signed with another key)")
    else:
        sig = existing_sig
    files = _parse_index(raw, key, f"entry {entry}")
    out = Path(out).expanduser()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(tmp, _write_mode(out), format=tarfile.PAX_FORMAT) as tar:
            now = time.time()
            tar.addfile(_member(f"{key}/{INDEX_FILE}", len(raw), now), io.BytesIO(raw))
            if sig is not None:
                tar.addfile(_member(f"{key}/{SIGNATURE_FILE}", len(sig), now), io.BytesIO(sig))
            for rel, record in sorted(files.items()):
                path = entry / rel
                try:
                    data, mtime = path.read_bytes(), path.stat().st_mtime
                except OSError as e:
                    raise CompileCacheError(f"cannot export {entry}: {rel} is unreadable ({e.strerror})") from None
                if len(data) != record["bytes"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
                    raise CompileCacheError(f"cannot export {entry}: {rel} does not match its checksum "
                                            f"(run `compiled-llm cache verify {key}`)")
                tar.addfile(_member(f"{key}/{rel}", len(data), mtime), io.BytesIO(data))
        os.replace(tmp, out)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # a folder given as the file, no permission, a full disk: one line
            raise CompileCacheError(f"cannot write {out}: {e.strerror or e}") from None
        raise
    return len(files)


def _parse_index(raw: bytes, key: str, where: str) -> dict[str, dict]:
    try:
        data = json.loads(raw)
        version, listed_key, files = data.get("version"), data.get("key"), data.get("files")
    except (ValueError, AttributeError):
        raise CompileCacheError(f"{where}: {INDEX_FILE} is unreadable") from None
    if version != INDEX_VERSION or listed_key != key or not isinstance(files, dict):
        raise CompileCacheError(f"{where}: {INDEX_FILE} is not a version {INDEX_VERSION} index for key {key}")
    for rel, record in files.items():
        if _unsafe(rel) or rel in (INDEX_FILE, SIGNATURE_FILE) or not isinstance(record, dict) \
                or not isinstance(record.get("bytes"), int) or not isinstance(record.get("sha256"), str):
            raise CompileCacheError(f"{where}: {INDEX_FILE} lists {rel!r} in a way no index written here does")
    return files


def _unsafe(rel: str) -> bool:
    path = PurePosixPath(rel)
    return (not rel or path.is_absolute() or "\\" in rel or any(part in ("", ".", "..") for part in rel.split("/")))


def _digest(stream: IO[bytes], sink: IO[bytes] | None = None) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    for chunk in iter(lambda: stream.read(CHUNK), b""):
        h.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
    return h.hexdigest(), size


def _check_archive(tar: tarfile.TarFile, archive: Path, signing_key: bytes | None) -> tuple[str, dict, dict]:
    """Everything about the archive, read without writing: (key, the index's files, members by
    relative path). Raises on the first thing that is wrong."""
    where = f"cannot import {archive}"
    members: dict[str, tarfile.TarInfo] = {}
    keys = set()
    for info in tar.getmembers():
        name = info.name
        if _unsafe(name.rstrip("/")) or name.startswith("/"):
            raise CompileCacheError(f"{where}: member {name!r} has an absolute or escaping path")
        if info.isdir():
            continue
        if not info.isreg():
            kind = "a link" if info.issym() or info.islnk() else "a device or special file"
            raise CompileCacheError(f"{where}: member {name!r} is {kind}, not a regular file")
        top, _, rel = name.partition("/")
        keys.add(top)
        if not is_entry_name(top) or not rel:
            raise CompileCacheError(f"{where}: member {name!r} is not inside one entry folder named by its key")
        if len(keys) > 1:
            raise CompileCacheError(f"{where}: it holds {len(keys)} entries, not one")
        if rel in members:
            raise CompileCacheError(f"{where}: member {name!r} appears twice")
        members[rel] = info
    if not keys:
        raise CompileCacheError(f"{where}: it holds no entry")
    key = keys.pop()
    if INDEX_FILE not in members:
        raise CompileCacheError(f"{where}: it has no {INDEX_FILE}")
    raw = tar.extractfile(members[INDEX_FILE]).read()
    if signing_key is not None:
        if SIGNATURE_FILE not in members:
            raise CompileCacheError(f"{where}: it is not signed (no {SIGNATURE_FILE}) and a cache signing key is given")
        sig = tar.extractfile(members[SIGNATURE_FILE]).read()
        if not hmac.compare_digest(sig.strip(), signature(signing_key, raw).encode().strip()):
            raise CompileCacheError(f"{where}: {INDEX_FILE} does not match its signature in {SIGNATURE_FILE} "
                                    f"(changed, or signed with another key)")
    files = _parse_index(raw, key, where)
    for rel in members:
        if rel not in files and rel not in (INDEX_FILE, SIGNATURE_FILE):
            raise CompileCacheError(f"{where}: member {key}/{rel} is not listed in its {INDEX_FILE}")
    for rel in sorted(files):
        if rel not in members:
            raise CompileCacheError(f"{where}: {rel}, listed in its {INDEX_FILE}, is missing")
    for rel, info in members.items():  # in the archive's order: a compressed one is read forward only
        record = files.get(rel)
        if record is not None and (info.size, _digest(tar.extractfile(info))[0]) != (record["bytes"], record["sha256"]):
            raise CompileCacheError(f"{where}: {key}/{rel} does not match its checksum")
    return key, files, members


def import_entry(root: str | Path | None, archive: str | Path, signing_key: bytes | None = None) -> tuple[str, str]:
    """Restore an exported entry into the cache folder `root`: (its key, what happened: "imported",
    "replaced" a damaged or unfinished entry, or "kept" a good one already there)."""
    archive = Path(archive).expanduser()
    try:
        tar = tarfile.open(archive, "r:*")
    except (OSError, tarfile.TarError) as e:
        raise CompileCacheError(f"cannot import {archive}: not a readable tar file ({e})") from None
    with tar:
        try:
            key, files, members = _check_archive(tar, archive, signing_key)
        except (*DAMAGED_ARCHIVE, OSError) as e:  # a download cut short: refuse it in one line, like any other damage
            raise CompileCacheError(f"cannot import {archive}: the archive is truncated or damaged ({e})") from None
        cache = CompileCache(root, key, {}, signing_key)
        try:
            cache.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CompileCacheError(f"cannot create the compile cache folder {cache.root}: {e.strerror}") from None
        staging = cache.root / f".{key}.import-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            for rel in members:
                dest = staging / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
                with os.fdopen(fd, "wb") as sink:
                    digest, size = _digest(tar.extractfile(members[rel]), sink)
                if rel in files and (size, digest) != (files[rel]["bytes"], files[rel]["sha256"]):
                    raise CompileCacheError(f"cannot import {archive}: {key}/{rel} changed while it was read")
                try:
                    os.utime(dest, (members[rel].mtime, members[rel].mtime))
                except (OverflowError, ValueError):
                    pass  # a time no file can have (a hand-made archive): the file keeps now
            return key, _install(cache, staging)
        except DAMAGED_ARCHIVE as e:
            raise CompileCacheError(f"cannot import {archive}: the archive is truncated or damaged ({e})") from None
        except OSError as e:  # two members that cannot both be (a file and a folder of one name), a full disk
            raise CompileCacheError(f"cannot import {archive} into {cache.root}: {e.strerror} ({e.filename})") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _install(cache: CompileCache, staging: Path) -> str:
    """Rename the checked copy into place under the entry's lock, unless a good entry is there."""
    with cache.locked() as lock:
        outcome = "imported"
        if cache.entry.exists():
            if cache.complete and not cache.verify():
                cache.mark_used(lock)
                return "kept"
            aside = cache.root / f"{cache.key}.broken-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            os.replace(cache.entry, aside)
            outcome = "replaced"
        os.replace(staging, cache.entry)
        return outcome
