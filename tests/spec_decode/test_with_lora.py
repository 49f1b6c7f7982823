"""LoRA with speculative decoding: verification runs each request's rows under its adapter, so greedy
outputs with n-gram or draft-model speculation are token for token those without it, in a batch
mixing two adapters and the base model. The draft model runs without adapters: with the target as
its own draft, its guesses are right for the base model's requests and often wrong for the
adapters', which the verification rejects."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.lora.request import LoRARequest
from tests.lora.adapters import ALL_TARGETS, make_adapter
from tests.spec_decode.test_ngram_e2e import REPEATING, assert_blocks_free

PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loras(small_vocab_llama, tmp_path_factory) -> list[LoRARequest | None]:
    """Per prompt: the base model, then two adapters (strong enough to change the greedy tokens)."""
    root = tmp_path_factory.mktemp("spec-lora")
    made = [make_adapter(small_vocab_llama, root / f"a{i}", 8, ALL_TARGETS, seed=i, std=0.3, merged=False)[0]
            for i in (1, 2)]
    return [None, LoRARequest("a1", 1, made[0]), LoRARequest("a2", 2, made[1])]


def make_llm(model: str, spec: dict | None) -> LLM:
    return LLM(model, speculative_config=spec, enable_lora=True, max_loras=2, max_lora_rank=8, optimization_level=0,
               max_model_len=256, kv_cache_memory_bytes=16 << 20)


def tokens(llm: LLM, loras: list[LoRARequest | None]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in REPEATING for _ in loras]
    outs = llm.generate(prompts, PARAMS, lora_request=loras * len(REPEATING), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(small_vocab_llama, loras) -> list[list[int]]:
    out = tokens(make_llm(small_vocab_llama, None), loras)
    assert out[0] != out[1] and out[0] != out[2], "the adapters changed nothing: their update was dropped"
    return out


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_speculation_equals_greedy_without(small_vocab_llama, loras, plain, method):
    spec = {"method": method, "num_speculative_tokens": 3, "measure_gain": False}
    spec.update({"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {"model": small_vocab_llama})
    llm = make_llm(small_vocab_llama, spec)
    assert tokens(llm, loras) == plain
    totals = llm.llm_engine.engine_core.scheduler.spec_totals
    assert totals.num_draft_tokens > 0 and totals.num_accepted_tokens > 0
    if method == "draft_model":  # the draft is the base model: the adapters' requests reject some guesses
        assert totals.num_accepted_tokens < totals.num_draft_tokens
    assert_blocks_free(llm)
