"""`compiled-llm serve` in a subprocess on a free loopback port, as a user runs it, with its log
kept for failure messages and every process it started reaped even when a test fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from compiled_llm.core.core_proc import ENGINE_PROC_TITLE
from compiled_llm.utils import get_open_port

START_TIMEOUT_S = 180


def is_alive(process: psutil.Process) -> bool:
    """Running and not a zombie (one whose parent has exited waits for init to reap it)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone between the two questions
        return False


class RemoteServer:
    def __init__(self, args: list[str], api_key: str | None = None, env: dict[str, str] | None = None) -> None:
        """`env`: variables set for the server on top of this process's environment."""
        self.port = get_open_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="compiled-llm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, COMPILED_LLM_NUM_THREADS=os.environ.get("COMPILED_LLM_NUM_THREADS", "2"), **(env or {}))
        # Its own process group, so a test can send Ctrl-C's SIGINT to the server and its engine.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._children: list[psutil.Process] = []
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during start-up:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self._children = psutil.Process(self.proc.pid).children(recursive=True)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server was not ready within {START_TIMEOUT_S} s:\n{self.read_log()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def engine_process(self) -> psutil.Process:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if ENGINE_PROC_TITLE in " ".join(child.cmdline()):
                return child
        raise LookupError("no engine core process under the server")

    def children_alive(self) -> list[psutil.Process]:
        return [p for p in self._children if is_alive(p)]

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-20000:]

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL for anything still there (the server and everything it started)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for child in self._children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self.log.close()
        os.unlink(self.log.name)
