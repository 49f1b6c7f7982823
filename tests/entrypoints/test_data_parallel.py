"""`compiled-llm serve --data-parallel-size 2`: two engine processes behind one server answer
concurrent streams, /metrics shows each engine (label engine="0"/"1"), requests sharing a prefix
meet in one engine's prefix cache, and one engine's death ends the server as a single engine's does."""

from __future__ import annotations

import asyncio
import re

import httpx
import psutil
import pytest
from remote_server import RemoteServer

from compiled_llm.core.core_proc import ENGINE_PROC_TITLE

openai = pytest.importorskip("openai")

FLAGS = ["-O0", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "16",
         "--data-parallel-size", "2", "--served-model-name", "tiny"]
TIMEOUT = 60


def engine_processes(server: RemoteServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if ENGINE_PROC_TITLE in " ".join(p.cmdline())]


def per_engine(server: RemoteServer, name: str) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    pattern = rf'^compiled_llm:{name}\{{[^}}]*engine="(\d+)"[^}}]*\}} (\S+)$'
    return {engine: float(value) for engine, value in re.findall(pattern, text, re.MULTILINE)}


@pytest.fixture(scope="module")
def server(tiny_llama):
    server = RemoteServer([tiny_llama, *FLAGS])
    yield server
    server.stop()


def test_two_engines_serve_concurrent_streams(server):
    assert len(engine_processes(server)) == 2

    async def one(c: openai.AsyncOpenAI, i: int) -> int:
        stream = await c.completions.create(model="tiny", prompt=f"Stream {i} of many says", max_tokens=12,
                                            stream=True, temperature=0.5, seed=i, extra_body={"ignore_eos": True})
        return sum([len(chunk.choices[0].text) > 0 async for chunk in stream])

    async def main() -> list[int]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        return await asyncio.gather(*(one(c, i) for i in range(16)))

    assert all(n > 0 for n in asyncio.run(main()))
    tokens = per_engine(server, "generation_tokens_total")
    assert set(tokens) == {"0", "1"} and all(v > 0 for v in tokens.values()), tokens
    assert sum(tokens.values()) == 16 * 12
    running = per_engine(server, "num_requests_running")
    assert set(running) == {"0", "1"}


def test_requests_sharing_a_prefix_meet_in_one_engine(server):
    shared = "You are a careful assistant who answers in one short sentence. " * 3
    before = per_engine(server, "prefix_cache_hits_total")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    for i in range(4):
        c.completions.create(model="tiny", prompt=shared + f"Question {i}?", max_tokens=2)
    after = per_engine(server, "prefix_cache_hits_total")
    gained = {e: after.get(e, 0) - before.get(e, 0) for e in after}
    assert sorted(gained.values())[0] == 0 and max(gained.values()) > 0, gained  # all on one engine


def test_one_engines_death_ends_the_server(tiny_llama):
    server = RemoteServer([tiny_llama, *FLAGS])
    try:
        engines = engine_processes(server)
        assert len(engines) == 2
        engines[1].kill()
        assert server.wait(timeout=30) == 1
        gone, alive = psutil.wait_procs(engines, timeout=15)
        assert alive == []
    finally:
        server.stop()
