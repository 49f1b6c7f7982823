"""The on-disk compile cache: one folder per cache key, self-sufficient.

```
<root>/<key>/factors.json      why this entry exists (the hashed factors, readable)
<root>/<key>/index.json        artifact name -> sha256 and size of its file
<root>/<key>/artifacts/*.bin   one Inductor artifact per (piece structure, shape range or size)
<root>/<key>/inductor/         TORCHINDUCTOR_CACHE_DIR while this entry is in use
<root>/<key>/triton/           TRITON_CACHE_DIR likewise
<root>/<key>/.lock             held while a process fills or reads the entry
```

Writes are atomic (temp file, then rename) and the index is only changed under the lock, so
concurrent starts never see half an artifact. An artifact is trusted only if its file matches
the checksum in the index.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from compiled_llm.logger import init_logger
from compiled_llm.utils import atomic_write_bytes, user_cache_dir

logger = init_logger(__name__)

INDEX_VERSION = 1


class CompileCacheMissError(RuntimeError):
    """Raised in strict mode (`require_cache_hit`) when an artifact is not in the cache."""


def default_cache_root() -> Path:
    return user_cache_dir() / "compile_cache"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class CompileCache:
    def __init__(self, root: str | Path | None, key: str, factors: dict[str, Any]) -> None:
        self.root = Path(root).expanduser() if root else default_cache_root()
        self.key = key
        self.factors = factors
        self.entry = self.root / key

    @property
    def artifacts_dir(self) -> Path:
        return self.entry / "artifacts"

    def artifact_path(self, name: str) -> Path:
        return self.artifacts_dir / f"{name}.bin"

    def prepare(self) -> None:
        """Create the entry and point Inductor's and Triton's own caches into it."""
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        factors = self.entry / "factors.json"
        if not factors.exists():
            atomic_write_bytes(factors, json.dumps(self.factors, indent=2, sort_keys=True, default=repr).encode())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.entry / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(self.entry / "triton")

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the entry's lock. It lives beside the entry, not in it: a broken entry is renamed
        away under the lock, and the next process must still wait on the same lock file."""
        self.entry.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".{self.key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def read_index(self) -> dict[str, dict[str, Any]]:
        path = self.entry / "index.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("Compile cache index %s is unreadable (%s); treating the entry as empty.", path, e)
            return {}
        if data.get("version") != INDEX_VERSION:
            return {}
        return data.get("artifacts", {})

    def write_index(self, artifacts: dict[str, dict[str, Any]]) -> None:
        payload = {"version": INDEX_VERSION, "artifacts": artifacts}
        atomic_write_bytes(self.entry / "index.json", json.dumps(payload, indent=1, sort_keys=True).encode())

    def verified_path(self, name: str, index: dict[str, dict[str, Any]]) -> Path | None:
        """The artifact's file if the index lists it and the file matches; None for a miss."""
        record = index.get(name)
        path = self.artifact_path(name)
        if record is None or not path.is_file():
            return None
        if path.stat().st_size != record.get("bytes") or file_sha256(path) != record.get("sha256"):
            raise ValueError(f"artifact {path} does not match its checksum (truncated or overwritten)")
        return path

    def record(self, name: str, index: dict[str, dict[str, Any]]) -> None:
        path = self.artifact_path(name)
        index[name] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}

    def set_aside(self, reason: str) -> Path:
        """Rename a broken entry out of the way (kept for inspection) and start a fresh one."""
        aside = self.root / f"{self.key}.broken-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.replace(self.entry, aside)
        logger.warning("Compile cache entry %s is broken (%s); moved it to %s and recompiling.", self.entry, reason, aside)
        self.prepare()
        return aside
