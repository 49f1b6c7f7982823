"""`compiled-llm serve --api-server-count 2`: two API server processes listen on one port in front
of one engine core. Concurrent streams spread over both and each gets all its tokens, /metrics adds
up both processes whichever answers, SIGTERM stops everything cleanly, and the engine's death fails
every open stream with its error and ends the whole group with status 1. (An API server's death
ending the group the same way was checked by hand; a third server start here costs CI 40 s.)"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from remote_server import RemoteServer, is_alive

from compiled_llm.core.core_proc import ENGINE_PROC_TITLE
from compiled_llm.entrypoints.openai.api_server_group import API_SERVER_PROC_TITLE

openai = pytest.importorskip("openai")

FLAGS = ["-O0", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "16",
         "--api-server-count", "2", "--served-model-name", "tiny"]
TIMEOUT = 60


def processes(server: RemoteServer, title: str) -> list[psutil.Process]:
    """The server's descendants whose command line has `title`. A child may end between the
    listing and the read of its command line (a short-lived worker, or one already a zombie):
    it is not one of those looked for, so it is skipped rather than raised (that failed a run)."""
    found = []
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if title in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:  # ZombieProcess included
            continue
    return found


def listening_api_servers(server: RemoteServer) -> list[psutil.Process]:
    """Both API server processes, once both listen: /health answered from the first one up, the
    other may still be loading."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = processes(server, API_SERVER_PROC_TITLE)
        if len(found) == 2 and all(any(c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
                                       for c in p.net_connections()) for p in found):
            return found
        time.sleep(0.2)
    raise TimeoutError(server.read_log())


def assert_group_ended(server: RemoteServer, children: list[psutil.Process], status: int,
                       within_s: float | None = None) -> None:
    """`serve` exited with `status` and left none of its processes behind; all that within `within_s`
    seconds of now (the signal just sent) when given."""
    started = time.monotonic()
    assert server.wait(timeout=30) == status, server.read_log()
    deadline = time.monotonic() + 15
    while any(is_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    assert not [p for p in children if is_alive(p)]
    if within_s is not None:
        assert elapsed < within_s, f"the group took {elapsed:.1f} s to end"


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^compiled_llm:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE))


async def stream_tokens(c: openai.AsyncOpenAI, i: int, max_tokens: int, started: asyncio.Barrier) -> int:
    """The tokens the stream's closing usage chunk counts; after its first chunk the stream waits
    at `started` (so the test acts while every stream is open)."""
    stream = await c.completions.create(model="tiny", prompt=f"Stream {i} of many says", max_tokens=max_tokens,
                                        stream=True, temperature=0.5, seed=i, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    usage, first = [], True
    async for chunk in stream:
        if first:
            first = False
            await started.wait()
        if chunk.usage is not None:
            usage.append(chunk.usage)
    return usage[-1].completion_tokens if usage else 0


def client(server: RemoteServer) -> openai.AsyncOpenAI:
    """Each stream on its own connection."""
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT,
                              http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=32)))


def test_two_api_servers_share_the_port_and_the_engine(tiny_llama):
    server = RemoteServer([tiny_llama, *FLAGS])
    try:
        api_servers = listening_api_servers(server)
        assert len(processes(server, ENGINE_PROC_TITLE)) == 1

        async def main() -> tuple[list[int], list[int]]:
            c, started = client(server), asyncio.Barrier(17)
            tasks = [asyncio.create_task(stream_tokens(c, i, 12, started)) for i in range(16)]
            await asyncio.wait_for(started.wait(), TIMEOUT)  # all 16 streams are open now
            connections = [sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == server.port
                               for c in p.net_connections()) for p in api_servers]
            counts = await asyncio.gather(*tasks)
            await c.close()
            return counts, connections

        counts, connections = asyncio.run(main())
        assert counts == [12] * 16
        # SO_REUSEPORT spreads the 16 connections by a hash: both processes take some.
        assert sum(connections) == 16 and min(connections) > 0, connections
        # Whichever process answers /metrics, it counts both processes' requests, and the
        # engine's own counters once.
        for _ in range(4):
            assert metric(server, "generation_tokens_total") == 16 * 12
            assert metric(server, "request_success_total") == 16
            assert metric(server, "iteration_tokens_total_sum") >= 16 * 12  # prompts and generated tokens
        # A plain request and the models list, through any process.
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        assert c.completions.create(model="tiny", prompt="Hello", max_tokens=3,
                                    extra_body={"ignore_eos": True}).usage.completion_tokens == 3

        children = psutil.Process(server.proc.pid).children(recursive=True)
        server.proc.send_signal(signal.SIGTERM)
        assert_group_ended(server, children, status=0, within_s=3)  # idle: about 1 s, as one server (issue 21)
    finally:
        server.stop()


def test_the_engines_death_fails_open_streams_and_ends_the_group(tiny_llama):
    server = RemoteServer([tiny_llama, *FLAGS])
    try:
        listening_api_servers(server)
        children = psutil.Process(server.proc.pid).children(recursive=True)

        async def main() -> list[str | int]:
            c, started = client(server), asyncio.Barrier(9)

            async def one(i: int) -> str | int:
                try:
                    return await stream_tokens(c, i, 400, started)
                except (openai.APIError, httpx.HTTPError) as e:
                    return type(e).__name__ + ": " + str(e)

            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            await asyncio.wait_for(started.wait(), TIMEOUT)  # all 8 streams are open
            processes(server, ENGINE_PROC_TITLE)[0].kill()
            return await asyncio.gather(*tasks)

        ends = asyncio.run(main())
        # Both API servers are alive to say why, in each stream.
        assert all(isinstance(end, str) and "exited unexpectedly" in end for end in ends), ends
        assert_group_ended(server, children, status=1)
    finally:
        server.stop()


def test_refused_with_data_parallelism(tiny_llama):
    out = subprocess.run([sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", tiny_llama, *FLAGS,
                          "--data-parallel-size", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "--api-server-count > 1 serves one engine core" in out.stdout + out.stderr
