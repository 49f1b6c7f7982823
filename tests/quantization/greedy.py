"""What the weight-format tests share: one engine's greedy tokens (with top-5) on the parity prompts."""

from __future__ import annotations

from compiled_llm import LLM, SamplingParams
from tests.models.test_hf_parity import PROMPTS
from tests.oracle import GreedyRun, ours_greedy

ENGINE = dict(optimization_level=0, max_model_len=512, kv_cache_memory_bytes=64 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, ignore_eos=True)


def greedy(model: str, quantization: str | None, **engine) -> list[GreedyRun]:
    """Greedy tokens of `model` served with `quantization` (an engine of its own, shut down after)."""
    llm = LLM(model, quantization=quantization, **{**ENGINE, **engine})
    try:
        return ours_greedy(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        llm.llm_engine.engine_core.shutdown()
