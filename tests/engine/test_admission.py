"""Admission control (`--max-num-queued-reqs`, `--max-num-queued-tokens`): the rule on its own,
and an engine that refuses what is over its limit at once, counts the refusal by reason, and
admits again once requests finish or are aborted."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, Coroutine

import pytest

from compiled_llm.engine.admission import AdmissionLimits, EngineBusyError
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.async_llm import AsyncLLM
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams

TIMEOUT = 120
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, TIMEOUT), loop).result(TIMEOUT + 5)


def states(*prompts_and_outputs: tuple[int, int]) -> dict[str, SimpleNamespace]:
    """In-flight requests: (prompt tokens, tokens generated so far) each."""
    return {f"r{i}": SimpleNamespace(prompt_token_ids=[1] * p, token_ids=[2] * g)
            for i, (p, g) in enumerate(prompts_and_outputs)}


def refusal(limits: AdmissionLimits, in_flight: dict, n: int = 1, admitting: int = 0) -> str | None:
    try:
        limits.check(in_flight, n, admitting)
    except EngineBusyError as e:
        return e.reason
    return None


def test_the_rules():
    reqs = AdmissionLimits(max_num_queued_reqs=3)
    assert refusal(reqs, states((5, 0), (5, 9))) is None  # 2 + 1 fit in 3
    assert refusal(reqs, states((5, 0), (5, 9)), n=2) == "max_num_queued_reqs"  # every sample counts
    assert refusal(reqs, states((5, 0), (5, 9), (1, 1))) == "max_num_queued_reqs"
    assert refusal(reqs, states((5, 0)), n=1, admitting=1) is None
    assert refusal(reqs, states((5, 0)), n=1, admitting=2) == "max_num_queued_reqs"  # admitted, not yet in flight
    tokens = AdmissionLimits(max_num_queued_tokens=100)
    # Only prompts with no output yet are a backlog; a request decoding is past its prefill.
    assert refusal(tokens, states((60, 0), (500, 3), (39, 0))) is None
    assert refusal(tokens, states((60, 0), (40, 0))) == "max_num_queued_tokens"
    assert refusal(AdmissionLimits(), states(*[(1000, 0)] * 1000), n=100) is None  # no limit, none refused
    assert refusal(AdmissionLimits(max_num_queued_tokens=0), {}) == "max_num_queued_tokens"
    assert "busy" in str(EngineBusyError("max_num_queued_reqs"))
    with pytest.raises(ValueError, match="max_num_queued_reqs must be >= 0"):
        AdmissionLimits(max_num_queued_reqs=-1)


@pytest.fixture(scope="module")
def engine(loop, tiny_llama):
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=tiny_llama, optimization_level=0, max_model_len=512, kv_cache_memory_bytes=32 << 20),
        admission=AdmissionLimits(max_num_queued_reqs=3))
    yield engine
    engine.shutdown()


def rejections(engine: AsyncLLM, reason: str) -> float:
    labels = {"model_name": engine.model_config.served_model_name, "reason": reason}
    return engine.metrics.registry.get_sample_value("compiled_llm:admission_rejections_total", labels)


def test_an_engine_refuses_past_its_limit_and_admits_again(loop, engine):
    async def main() -> None:
        assert rejections(engine, "max_num_queued_reqs") == 0  # the series exists before any refusal
        first = await engine.add_request("a", "Once upon a time", LONG)
        pair = await engine.add_request("b", "Once upon a time", LONG.clone(n=2, temperature=1.0))
        with pytest.raises(EngineBusyError) as refused:
            await engine.add_request("c", "Hello", LONG)
        assert refused.value.reason == "max_num_queued_reqs"
        assert rejections(engine, "max_num_queued_reqs") == 1
        assert rejections(engine, "max_num_queued_tokens") == 0
        assert "c" not in engine._streams  # nothing of the refused request is left behind
        async for out in first:  # the admitted ones run on
            if out.outputs[0].token_ids:
                break
        await engine.abort("b")  # its two samples leave: room for two
        second = await engine.add_request("d", "Hello", LONG.clone(max_tokens=3))
        outs = [out async for out in second]
        assert outs[-1].finished and sum(len(out.outputs[0].token_ids) for out in outs) == 3
        await engine.abort("a")
        del pair

    run(loop, main())


def test_a_burst_is_bounded_too(loop, engine):
    """Requests sent at once are all checked before the first is tokenized and registered: the
    ones admitted but still being tokenized count against the limit."""
    async def one(i: int) -> str:
        try:
            stream = await engine.add_request(f"burst-{i}", "Once upon a time " * 20, LONG)
        except EngineBusyError:
            return "refused"
        await engine.abort(stream.request_id)
        return "admitted"

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    outcomes = run(loop, main())
    assert outcomes.count("admitted") == 3 and outcomes.count("refused") == 5, outcomes
