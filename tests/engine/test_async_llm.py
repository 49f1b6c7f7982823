"""`AsyncLLM` without HTTP: streams in each output kind, `n > 1`, aborts that free the engine,
stop strings found on the frontend, validation, slow readers, and the engine's death."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any, Coroutine

import pytest

from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.async_llm import AsyncLLM
from compiled_llm.engine.core_client import EngineDeadError
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams

TIMEOUT = 60
DELTA, CUMULATIVE, FINAL = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, TIMEOUT), loop).result(TIMEOUT + 5)


def start_engine(model: str) -> AsyncLLM:
    return AsyncLLM.from_engine_args(EngineArgs(model=model, optimization_level=0, max_num_seqs=16))


async def shut_down(engine: AsyncLLM) -> None:
    engine.shutdown()


@pytest.fixture(scope="module")
def engine(loop, tiny_llama):
    engine = start_engine(tiny_llama)
    yield engine
    run(loop, shut_down(engine))


def params(kind: RequestOutputKind, max_tokens: int = 16, **kwargs: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, "output_kind": kind,
                             **kwargs})


async def outputs(engine: AsyncLLM, prompt: Any, p: SamplingParams, rid: str) -> list:
    return [out async for out in engine.generate(prompt, p, rid)]


def gauge(engine: AsyncLLM, name: str) -> float:
    labels = {"model_name": engine.model_config.served_model_name, "engine": "0"}
    return engine.metrics.registry.get_sample_value(f"compiled_llm:{name}", labels) or 0.0


async def wait_idle(engine: AsyncLLM) -> None:
    while gauge(engine, "num_requests_running") or gauge(engine, "kv_cache_usage_perc"):
        await asyncio.sleep(0.05)


def test_output_kinds_agree(loop, engine):
    async def main() -> None:
        final = await outputs(engine, "Hello there", params(FINAL), "final")
        delta = await outputs(engine, "Hello there", params(DELTA), "delta")
        cumulative = await outputs(engine, "Hello there", params(CUMULATIVE), "cumulative")
        assert len(final) == 1 and final[0].finished
        text, ids = final[0].outputs[0].text, final[0].outputs[0].token_ids
        assert len(ids) == 16
        assert "".join(o.outputs[0].text for o in delta) == text
        assert [t for o in delta for t in o.outputs[0].token_ids] == ids
        assert cumulative[-1].outputs[0].text == text and cumulative[-1].outputs[0].token_ids == ids
        lengths = [len(c.outputs[0].token_ids) for c in cumulative]
        assert all(a <= b for a, b in zip(lengths, lengths[1:]))
        assert final[0].metrics.first_token_time >= final[0].metrics.arrival_time

    run(loop, main())


def test_parallel_sampling(loop, engine):
    async def main() -> None:
        p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, output_kind=FINAL)
        (final,) = await outputs(engine, "Hi", p, "n3")
        assert [c.index for c in final.outputs] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in final.outputs)
        deltas = await outputs(engine, "Hi", p.clone(output_kind=DELTA), "n3-delta")
        per_child = {i: "".join(c.text for o in deltas for c in o.outputs if c.index == i) for i in range(3)}
        assert per_child == {c.index: c.text for c in final.outputs}
        assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])

    run(loop, main())


def test_leaving_the_stream_aborts_in_the_engine(loop, engine):
    async def main() -> None:
        gen = engine.generate("Go on", params(DELTA, 900), "leave")
        async for out in gen:
            if len(out.outputs[0].token_ids) and gauge(engine, "num_requests_running"):
                break
        await gen.aclose()
        assert engine.num_open_requests == 0
        await wait_idle(engine)

        # Cancelling the reading task (an HTTP client going away) does the same.
        async def read() -> None:
            async for _ in engine.generate("Go on", params(DELTA, 900), "cancelled"):
                pass

        task = asyncio.ensure_future(read())
        while not gauge(engine, "num_requests_running"):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)

        # abort() from elsewhere ends the reader's stream with finish reason "abort".
        stream = await engine.add_request("other", "Go on", params(DELTA, 900))
        first = await anext(stream)
        await engine.abort("other")
        rest = [o async for o in stream]
        assert first.outputs[0].finish_reason is None and rest[-1].outputs[0].finish_reason == "abort"
        await wait_idle(engine)

    run(loop, main())


def test_stop_string_found_on_the_frontend(loop, engine):
    async def main() -> None:
        (full,) = await outputs(engine, "Stop here", params(FINAL, 24), "nostop")
        text = full.outputs[0].text
        stop = text[len(text) // 2: len(text) // 2 + 3]
        (cut,) = await outputs(engine, "Stop here", params(FINAL, 24, stop=[stop]), "stop")
        c = cut.outputs[0]
        assert c.text == text[: text.index(stop)] and c.finish_reason == "stop" and c.stop_reason == stop
        assert len(c.token_ids) < 24
        await wait_idle(engine)  # the engine was told to abort; its blocks are free

    run(loop, main())


def test_validation_errors(loop, engine):
    async def main() -> None:
        with pytest.raises(ValueError, match="longer than the maximum context length of 1024"):
            await outputs(engine, list(range(1, 1100)), params(FINAL), "long")
        with pytest.raises(ValueError, match="empty"):
            await outputs(engine, "", params(FINAL), "empty")
        with pytest.raises(ValueError, match="logprobs"):
            await outputs(engine, "x", params(FINAL, logprobs=21), "lp")
        stream = await engine.add_request("dup", "x", params(FINAL, 4))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("dup", "x", params(FINAL, 4))
        assert [o.finished for o in [o async for o in stream]] == [True]
        # A user's id equal to a child id of an open n > 1 request is refused, and both go on.
        parent = await engine.add_request("x", "x", params(FINAL, 4, n=2, temperature=1.0))
        child_id = parent.engine_ids[0]
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request(child_id, "x", params(FINAL, 4))
        (final,) = [o async for o in parent]
        assert len(final.outputs) == 2 and all(len(c.token_ids) == 4 for c in final.outputs)
        assert len((await outputs(engine, "x", params(FINAL, 4), child_id))[0].outputs[0].token_ids) == 4
        assert engine.num_open_requests == 0

    run(loop, main())


def test_slow_reader_gets_merged_outputs(loop, engine):
    async def main() -> None:
        (final,) = await outputs(engine, "Slow", params(FINAL, 30), "fast")
        stream = await engine.add_request("slow", "Slow", params(DELTA, 30))
        await asyncio.sleep(1.0)  # the engine runs ahead; deltas pile up and are merged
        got = [o async for o in stream]
        assert len(got) < 30
        assert "".join(o.outputs[0].text for o in got) == final.outputs[0].text
        assert [t for o in got for t in o.outputs[0].token_ids] == final.outputs[0].token_ids

    run(loop, main())


def test_stream_interval_sends_tokens_in_groups(loop, engine):
    """With a stream interval of 4, a delta stream gets its first token at once, then events of at
    least 4 tokens, then the rest with the last event; the tokens and text are unchanged, and a
    request that ends before 4 more tokens still ends (its last event is never held back)."""
    async def main() -> None:
        (final,) = await outputs(engine, "Grouped", params(FINAL, 30), "grouped-final")
        (short,) = await outputs(engine, "Grouped", params(FINAL, 3), "short-final")
        engine.stream_interval = 4
        try:
            got = await outputs(engine, "Grouped", params(DELTA, 30), "grouped")
            brief = await outputs(engine, "Grouped", params(DELTA, 3), "short")
        finally:
            engine.stream_interval = 1
        sizes = [len(o.outputs[0].token_ids) for o in got]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and got[-1].finished
        assert len(got) <= 1 + 29 // 4 + 1
        assert "".join(o.outputs[0].text for o in got) == final.outputs[0].text
        assert [t for o in got for t in o.outputs[0].token_ids] == final.outputs[0].token_ids
        assert [t for o in brief for t in o.outputs[0].token_ids] == short.outputs[0].token_ids and brief[-1].finished

    run(loop, main())


def test_many_concurrent_requests(loop, engine):
    async def main() -> None:
        async def one(i: int) -> int:
            outs = await outputs(engine, f"Prompt {i}", params(DELTA, 5 + i % 7, temperature=0.5, seed=i), f"c{i}")
            return sum(len(o.outputs[0].token_ids) for o in outs)

        counts = await asyncio.gather(*(one(i) for i in range(32)))
        assert counts == [5 + i % 7 for i in range(32)]

    run(loop, main())


def test_engine_death_ends_every_stream(loop, tiny_llama):
    engine = start_engine(tiny_llama)
    try:
        async def main() -> None:
            streams = [await engine.add_request(f"d{i}", "Go on", params(DELTA, 900)) for i in range(3)]
            await anext(streams[0])
            os.kill(engine.client.pid, signal.SIGKILL)
            for stream in streams:
                with pytest.raises(EngineDeadError):
                    async for _ in stream:
                        pass
            assert engine.errored and not engine.is_running
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                await engine.add_request("late", "x", params(FINAL))
            assert "exited unexpectedly" in str(await engine.wait_until_dead())

        run(loop, main())
    finally:
        run(loop, shut_down(engine))
