"""The engine core in its own process: same tokens as in-process, utility calls, a clear start-up
error, and death noticed however it happens (exit, signal, hang), with no process left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from compiled_llm.core.core_proc import ENGINE_PROC_TITLE
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.core_client import AsyncMPClient, EngineDeadError, EngineStartupError, InprocClient
from compiled_llm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest
from compiled_llm.sampling_params import SamplingParams

TIMEOUT = 60


def config(model: str, **kwargs):
    return EngineArgs(model=model, optimization_level=0, **kwargs).create_engine_config()


def request(rid: str, max_tokens: int = 8, prompt: list[int] | None = None) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(rid, prompt or [1, 100, 200, 300, 400], params, time.time())


async def collect(client: AsyncMPClient, ids: set[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    open_ids = set(ids)
    while open_ids:
        outputs: EngineCoreOutputs = await asyncio.wait_for(client.get_output_async(), TIMEOUT)
        for out in outputs.outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                open_ids.discard(out.request_id)
    return tokens


@pytest.fixture
def mp_client(tiny_llama):
    client = AsyncMPClient(config(tiny_llama))
    yield client
    client.shutdown()


def test_same_tokens_as_in_process(tiny_llama, mp_client):
    inproc = InprocClient(config(tiny_llama))
    reqs = [request("a", 8), request("b", 5, [1, 7, 8, 9])]
    for r in reqs:
        inproc.add_request(r)
    expected: dict[str, list[int]] = {"a": [], "b": []}
    while inproc.has_unfinished_requests():
        for out in inproc.get_output().outputs:
            expected[out.request_id] += out.new_token_ids

    async def main() -> dict[str, list[int]]:
        for r in reqs:
            await mp_client.add_request_async(r)
        return await collect(mp_client, {"a", "b"})

    assert asyncio.run(main()) == expected
    assert [len(expected["a"]), len(expected["b"])] == [8, 5]


def test_process_title_utilities_and_clean_shutdown(mp_client):
    proc = psutil.Process(mp_client.pid)
    assert ENGINE_PROC_TITLE in " ".join(proc.cmdline())
    assert proc.ppid() == os.getpid()

    async def main() -> None:
        assert await mp_client.call_utility_async("ping") == "pong"
        assert await mp_client.reset_prefix_cache_async() is True
        with pytest.raises(RuntimeError, match="Unknown utility"):
            await mp_client.call_utility_async("os.system", "true")
        # An abort frees the request; the engine publishes stats once it is idle again.
        await mp_client.add_request_async(request("long", 500))
        first = await asyncio.wait_for(mp_client.get_output_async(), TIMEOUT)
        assert first.scheduler_stats.num_running_reqs == 1
        await mp_client.abort_requests_async(["long"])
        while True:
            out = await asyncio.wait_for(mp_client.get_output_async(), TIMEOUT)
            if not out.outputs:
                break
        assert out.scheduler_stats.num_running_reqs == 0 and out.scheduler_stats.kv_cache_usage == 0

    asyncio.run(main())
    mp_client.shutdown()
    assert mp_client.proc.exitcode == 0 and not proc.is_running()


def test_start_up_failure_is_a_clear_error(tiny_llama):
    started = time.monotonic()
    with pytest.raises(EngineStartupError, match="failed to start: ValueError: The KV cache .* cannot hold"):
        AsyncMPClient(config(tiny_llama, kv_cache_memory_bytes=4096))
    assert time.monotonic() - started < TIMEOUT
    assert [p for p in psutil.Process().children() if ENGINE_PROC_TITLE in " ".join(p.cmdline())] == []


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_engine_death_fails_open_requests(mp_client, how):
    async def main() -> None:
        await mp_client.add_request_async(request("x", 900))
        await asyncio.wait_for(mp_client.get_output_async(), TIMEOUT)
        os.kill(mp_client.pid, getattr(signal, how))
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            while True:
                await asyncio.wait_for(mp_client.get_output_async(), TIMEOUT)
        with pytest.raises(EngineDeadError):
            await mp_client.add_request_async(request("y"))
        with pytest.raises(EngineDeadError):
            await mp_client.get_output_async()

    asyncio.run(main())
    if how == "SIGTERM":
        assert mp_client.proc.exitcode == 0  # the engine's own clean exit


def test_hung_engine_is_declared_dead(tiny_llama):
    client = AsyncMPClient(config(tiny_llama), engine_timeout_s=5)
    try:
        async def main() -> None:
            await client.add_request_async(request("x", 900))
            await asyncio.wait_for(client.get_output_async(), TIMEOUT)
            os.kill(client.pid, signal.SIGSTOP)
            with pytest.raises(EngineDeadError, match="stopped answering"):
                while True:
                    await asyncio.wait_for(client.get_output_async(), TIMEOUT)

        asyncio.run(main())
        client.proc.join(10)
        assert not client.proc.is_alive()
    finally:
        client.shutdown()


def test_engine_exits_when_its_parent_dies(tiny_llama):
    script = textwrap.dedent(f"""
        import sys, time
        from compiled_llm.engine.arg_utils import EngineArgs
        from compiled_llm.engine.core_client import AsyncMPClient
        if __name__ == "__main__":
            client = AsyncMPClient(EngineArgs(model={tiny_llama!r}, optimization_level=0).create_engine_config())
            print(client.pid, flush=True)
            time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())
        engine = psutil.Process(engine_pid)
        parent.kill()
        parent.wait(10)
        engine.wait(20)  # raises TimeoutExpired if it outlives its parent
    finally:
        parent.kill()
        try:
            psutil.Process(engine_pid).kill()
        except (psutil.NoSuchProcess, UnboundLocalError, ValueError):
            pass
