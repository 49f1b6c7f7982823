"""vLLM's metric families that need a run to show: requests waiting by reason (capacity or
deferred), the KV cache's configuration as an info gauge, and preemptions per finished request,
on a tiny model with a KV cache small enough that requests preempt each other."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Coroutine

import pytest

from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.async_llm import AsyncLLM
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams

TIMEOUT = 120
BLOCKS = 64  # of 16 tokens: ~1000 tokens for 12 requests that grow to ~170 each
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny Llama's: K and V, 2 layers, 16 tokens, 2 KV heads of 16 floats


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, TIMEOUT), loop).result(TIMEOUT + 5)


@pytest.fixture(scope="module")
def engine(loop, tiny_llama):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, optimization_level=0, max_num_seqs=16,
                                                  max_model_len=256, kv_cache_memory_bytes=BLOCKS * BLOCK_BYTES))
    yield engine
    engine.shutdown()


def sample(engine: AsyncLLM, name: str, **labels: str) -> float | None:
    labels = {"model_name": engine.model_config.served_model_name, "engine": "0", **labels}
    return engine.metrics.registry.get_sample_value(f"compiled_llm:{name}", labels)


async def generate_all(engine: AsyncLLM, prompts: list[str], params: SamplingParams) -> None:
    async def one(i: int, prompt: str) -> None:
        async for _ in engine.generate(prompt, params, f"r{i}-{time.monotonic_ns()}"):
            pass

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_cache_config_info(engine):
    labels = {"block_size": "16", "enable_prefix_caching": "True", "kv_cache_memory_bytes": str(BLOCKS * BLOCK_BYTES),
              "gpu_memory_utilization": "0.9", "num_gpu_blocks": str(BLOCKS),
              "kv_cache_size_tokens": str(BLOCKS * 16), "kv_cache_max_concurrency": str(BLOCKS * 16 / 256)}
    assert sample(engine, "cache_config_info", **labels) == 1


def test_preemptions_per_finished_request(loop, engine):
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    count_before = sample(engine, "request_num_preemptions_count") or 0
    total_before = sample(engine, "num_preemptions_total") or 0
    run(loop, generate_all(engine, [f"Story number {i}: once upon a time" for i in range(12)], params))
    preemptions = sample(engine, "num_preemptions_total") - total_before
    assert preemptions > 0  # the cache was too small for all of them
    assert sample(engine, "request_num_preemptions_count") - count_before == 12
    assert sample(engine, "request_num_preemptions_sum") == preemptions  # each counted with its request
    assert sample(engine, "request_num_preemptions_bucket", le="0.0") < 12  # some were preempted


def test_waiting_by_reason(loop, engine):
    """A request of n = 20 samples holds 14 of the 16 slots (its share); its other 6 samples wait,
    deferred by that rule rather than for room."""
    params = SamplingParams(n=20, temperature=1.0, max_tokens=100, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    seen: set[tuple[float | None, float | None]] = set()

    async def watch(task: asyncio.Future) -> None:
        while not task.done():
            seen.add((sample(engine, "num_requests_waiting_by_reason", reason="deferred"),
                      sample(engine, "num_requests_waiting_by_reason", reason="capacity")))
            await asyncio.sleep(0.005)

    async def main() -> None:
        task = asyncio.ensure_future(generate_all(engine, ["Hello"], params))
        await watch(task)
        await task

    run(loop, main())
    assert (6.0, 0.0) in seen
    assert sample(engine, "num_requests_waiting_by_reason", reason="deferred") == 0
    assert sample(engine, "num_requests_waiting_by_reason", reason="capacity") == 0
