"""Small helpers shared by several layers: paths, devices, CPU flags, free ports, atomic writes,
process exit and the watch on a parent process, optional imports, and the user's errors."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import signal
import socket
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NoReturn

if TYPE_CHECKING:  # imported where used: the chat template workers import this module and no torch
    import torch


def env_flag(*names: str) -> bool:
    """A switch set in the environment under any of `names` (vLLM's name and ours): 1 or true."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in names)


def user_cache_dir() -> Path:
    """Root of everything this package caches on disk.

    `COMPILED_LLM_CACHE` wins, then `$XDG_CACHE_HOME/compiled-llm`, then `~/.cache/compiled-llm`.
    """
    explicit = os.environ.get("COMPILED_LLM_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "compiled-llm"


class UserError(Exception):
    """A problem the user can fix (a setting, a file, a cache that must be warm): reported in one
    line, without a traceback, by whichever process meets it."""


def default_device() -> torch.device:
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux: /proc/cpuinfo; empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` so that readers see either the old file or the whole new one. The file gets
    the permissions a plain `open` would give it (mkstemp's are owner-only), so that a cache built
    by one user (an image build) can be read by another (the server). If the write fails (a full
    disk), no temp file is left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def get_open_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def import_ray() -> Any:
    """The `ray` module, or an ImportError that says how to install it (an optional dependency)."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "--distributed-executor-backend ray needs Ray: pip install 'compiled-llm[ray]'"
        ) from e
    return ray


def random_uuid() -> str:
    import uuid

    return uuid.uuid4().hex


def freeze_gc_heap() -> None:
    """Take every object made so far (modules, the model, the tokenizer: most of a serving
    process's heap) out of the garbage collector's reach, once start-up is done. A full collection
    otherwise walks all of them: a stall of one to two seconds on a 2-core machine, at whatever
    moment the collector picks, under load (vLLM freezes its start-up heap the same way). The
    collector is on again afterwards, where `serve` paused it for its start-up (cli.py)."""
    gc.collect()
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while start-up makes its long-lived objects (torch's modules, the
    engine's, the model): each full collection would walk all of them again, three or more times
    over a warm start (0.1-0.2 s of 1.5 s on a 2-core machine). The collector is back on after
    (if it was on), and its next collection walks them once."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def watch_parent_pipe(conn: Connection) -> None:
    """Block on a pipe from the process that started this one (its start-up pipe); its end of file
    means that process is gone: exit (SIGTERM to ourselves, so the usual clean-up runs)."""
    try:
        while True:
            conn.recv_bytes()
    except (EOFError, OSError):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def exit_without_teardown(code: int) -> NoReturn:
    """End this process with `code` as `sys.exit` would, minus the interpreter's own teardown.

    The `atexit` handlers run (multiprocessing joins or stops this process's children, logging
    flushes, `weakref.finalize` removes temp folders) and the standard streams are flushed; then
    `os._exit`. The teardown skipped is the interpreter collecting and freeing its whole heap
    (torch, Dynamo and Inductor, transformers, the model: some 350k objects in the engine core,
    almost 600k in an API server): several full garbage collections of a second or more each on a
    busy 2-core machine, for memory the kernel takes back at once anyway. For a process's entry
    point only, once its own clean-up (sockets, child processes, threads) is done."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os._exit(code)
