"""Greedy parity with HF transformers: the real SmolLM2-135M and tiny Llama / Qwen2 / Qwen3 models."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams
from tests.oracle import check_close, hf_greedy, ours_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 5, 8, 13,",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Translate to German: The weather is nice today.",
    "A",
    "In a distant galaxy, far beyond the reach of the brightest telescopes, a small planet orbited "
    "two suns. Its inhabitants had learned long ago that the sky was never quite dark, and so",
    "Q: What is the boiling point of water in Fahrenheit?\nA:",
]


def _run_ours(model: str, prompts: list[str], max_tokens: int, **kwargs):
    llm = LLM(model=model, optimization_level=0, max_model_len=1024, **kwargs)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    return ids, outputs


@pytest.mark.slow
def test_real_model_matches_hf(real_model_path):
    ids, outputs = _run_ours(real_model_path, PROMPTS, 48)
    exact = check_close(ours_greedy(outputs), hf_greedy(real_model_path, ids, 48))
    assert exact >= len(PROMPTS) // 2, f"only {exact} of {len(PROMPTS)} prompts matched exactly"


ARCHS = ["llama", "llama-biased", "qwen2", "qwen2-tied", "qwen3", "qwen3-biased", "llama3-scaled"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_match_hf(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    ids, outputs = _run_ours(path, PROMPTS[:4], 24)
    exact = check_close(ours_greedy(outputs), hf_greedy(path, ids, 24))
    assert exact == 4, f"fp32 tiny {arch}: only {exact} of 4 prompts matched HF exactly"
