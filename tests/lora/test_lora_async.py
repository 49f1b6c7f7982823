"""LoRA through the server's frontend (`AsyncLLM`, the engine core in its own process): streamed
requests for two adapters and the base model at once give the offline API's tokens, and a bad
adapter is refused before anything is queued while the others stream on."""

from __future__ import annotations

import asyncio

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.async_llm import AsyncLLM
from compiled_llm.lora.request import LoRARequest
from compiled_llm.sampling_params import RequestOutputKind
from tests.lora.adapters import ALL_TARGETS, make_adapter

SETTINGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8, optimization_level=0, kv_cache_memory_bytes=8 << 20,
                max_model_len=256)


def test_streamed_adapters_equal_offline(tiny_llama, tmp_path):
    every, _ = make_adapter(tiny_llama, tmp_path / "every", 8, ALL_TARGETS, seed=1, merged=False)
    qv, _ = make_adapter(tiny_llama, tmp_path / "qv", 4, ["q_proj", "v_proj"], seed=2, merged=False)
    requests = [None, LoRARequest("every", 1, every), LoRARequest("qv", 2, qv)]
    prompt = "Once upon a time, there"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = LLM(tiny_llama, **SETTINGS)
    expected = [list(o.outputs[0].token_ids) for o in offline.generate([prompt] * 3, params, lora_request=requests,
                                                                       use_tqdm=False)]

    async def main() -> list[list[int]]:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **SETTINGS))
        try:
            delta = params.clone(output_kind=RequestOutputKind.DELTA)

            async def stream(i: int, request: LoRARequest | None) -> list[int]:
                return [t async for out in engine.generate(prompt, delta, f"r{i}", lora_request=request)
                        for t in out.outputs[0].token_ids]

            tasks = [asyncio.create_task(stream(i, r)) for i, r in enumerate(requests)]
            with pytest.raises(ValueError, match="not a folder"):
                await engine.add_request("bad", prompt, delta, lora_request=LoRARequest("bad", 9, str(tmp_path / "x")))
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == expected
