"""The new request features through `AsyncLLM` and a real engine process: constrained requests
stream text in their language and stop when their grammar is complete, several at once sharing a
schema; prompt logprobs arrive with the first delta; logit_bias forces a token; a bad constraint
is a ValueError before the engine, which keeps serving."""

from __future__ import annotations

import asyncio
import re
from typing import Any, Coroutine

import pytest

from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.async_llm import AsyncLLM
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams
from compiled_llm.sampling_params import StructuredOutputsParams as SO

TIMEOUT = 90
DELTA = RequestOutputKind.DELTA


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, TIMEOUT), loop).result(TIMEOUT + 5)


@pytest.fixture(scope="module")
def engine(loop, tiny_llama):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, optimization_level=0, max_num_seqs=8,
                                                  max_model_len=256, kv_cache_memory_bytes=16 << 20))
    yield engine

    async def shut_down() -> None:
        engine.shutdown()

    run(loop, shut_down())


async def collect(engine: AsyncLLM, prompt: str, params: SamplingParams, rid: str) -> tuple[str, list, Any]:
    """(text, finish reasons, prompt logprobs of each delta) of a DELTA stream."""
    text, reasons, prompt_logprobs = "", [], []
    async for out in engine.generate(prompt, params, rid):
        text += out.outputs[0].text
        reasons.append(out.outputs[0].finish_reason)
        prompt_logprobs.append(out.prompt_logprobs)
    return text, reasons, prompt_logprobs


def test_constrained_streams_in_the_engine_process(loop, engine):
    person = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["id"]}
    cases = [
        (SO(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (SO(regex=r"[0-9]{2}:[0-9]{2}"), lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
        (SO(json=person, disable_any_whitespace=True), lambda t: re.fullmatch(r'\{"id": [0-9]{1,2}\}', t)),
        (SO(json=person, disable_any_whitespace=True), lambda t: re.fullmatch(r'\{"id": [0-9]{1,2}\}', t)),
    ]

    async def main():
        return await asyncio.gather(*[
            collect(engine, f"case {i}", SamplingParams(temperature=1.0, seed=i, max_tokens=40, output_kind=DELTA,
                                                        structured_outputs=constraint), f"c{i}")
            for i, (constraint, _) in enumerate(cases)
        ])

    for (text, reasons, _), (constraint, check) in zip(run(loop, main()), cases):
        assert check(text), (constraint, text)
        assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])


def test_prompt_logprobs_first_delta_and_logit_bias(loop, engine):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, output_kind=DELTA, prompt_logprobs=2,
                            logit_bias={1234: 100.0})
    text, reasons, prompt_logprobs = run(loop, collect(engine, "one two three", params, "p"))
    assert prompt_logprobs[0] is not None and prompt_logprobs[0][0] is None and len(prompt_logprobs[0]) > 1
    assert all(p is None for p in prompt_logprobs[1:])
    assert text == engine.tokenizer.decode([1234] * 3) and reasons[-1] == "length"


def test_a_bad_constraint_is_refused_and_the_engine_serves_on(loop, engine):
    with pytest.raises(ValueError, match="Invalid structured outputs grammar"):
        run(loop, collect(engine, "x", SamplingParams(structured_outputs=SO(grammar="root ::= (")), "bad"))
    text, reasons, _ = run(loop, collect(engine, "x", SamplingParams(max_tokens=5, output_kind=DELTA,
                                                                     structured_outputs=SO(choice=["ok"])), "good"))
    assert text == "ok" and reasons[-1] == "stop"
