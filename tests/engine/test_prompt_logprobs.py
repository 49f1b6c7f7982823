"""Prompt logprobs, offline `LLM` and in-process engine: on the bundled model in float32 they are
HF transformers' log-likelihood of the same text (per token, and top-5 close as the parity tests
compare), the same whether the prompt is prefilled in one chunk or in many, whole even when the
prompt's blocks are in the prefix cache, and `max_tokens=0` scores a prompt without generating."""

from __future__ import annotations

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.sampling_params import RequestOutputKind

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
]
TOP = 5
SCORE = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=TOP)


def make_llm(model: str, **engine) -> LLM:
    return LLM(model, optimization_level=0, max_model_len=512, kv_cache_memory_bytes=32 << 20, **engine)


@pytest.fixture(scope="module")
def whole(real_model_path):
    return make_llm(real_model_path)


@pytest.fixture(scope="module")
def chunked(real_model_path):
    """Prompts prefilled 16 tokens a step."""
    return make_llm(real_model_path, max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def hf_logprobs(real_model_path, whole):
    """HF's log_softmax at every prompt position, for each prompt (as our tokenizer encodes it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_model_path, dtype=torch.float32).eval()
    tokenizer = whole.get_tokenizer()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            out.append((ids, model(torch.tensor([ids])).logits[0].float().log_softmax(-1)))
    return out


def test_prompt_logprobs_are_hf_log_likelihoods(whole, hf_logprobs):
    outs = whole.generate(PROMPTS, SCORE, use_tqdm=False)
    for out, (ids, hf) in zip(outs, hf_logprobs):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for pos in range(1, len(ids)):
            entry, expected = out.prompt_logprobs[pos], hf[pos - 1]
            token = ids[pos]
            first = next(iter(entry))
            assert first == token  # the prompt's own token comes first
            assert entry[token].logprob == pytest.approx(expected[token].item(), abs=2e-3), f"position {pos}"
            # Its rank, up to tokens within the tolerance of it.
            lp = expected[token].item()
            assert int((expected > lp + 2e-3).sum()) < entry[token].rank <= int((expected > lp - 2e-3).sum()) + 1
            ours_top = [t for t, logprob in entry.items() if logprob.rank <= TOP]
            hf_top = expected.topk(TOP).indices.tolist()
            best = next(t for t, logprob in entry.items() if logprob.rank == 1)
            assert best in hf_top and hf_top[0] in ours_top, f"position {pos}: ours {ours_top}, hf {hf_top}"
            assert entry[token].decoded_token == whole.get_tokenizer().decode([token])


def comparable(out) -> list:
    return [None if d is None else [(t, lp.rank) for t, lp in d.items()] for d in out.prompt_logprobs]


def test_one_chunk_or_many_give_the_same_prompt_logprobs(whole, chunked):
    a = whole.generate(PROMPTS, SCORE, use_tqdm=False)
    b = chunked.generate(PROMPTS, SCORE, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in b) > 2 * 16  # prefilled over several steps
    for x, y in zip(a, b):
        assert comparable(x) == comparable(y)
        for dx, dy in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            for token in dx:
                assert dx[token].logprob == pytest.approx(dy[token].logprob, abs=1e-4)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(chunked):
    prompt = PROMPTS[0] + " Rome. " + PROMPTS[0]  # longer than a block, served again below
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    first = chunked.generate([prompt], plain, use_tqdm=False)[0]
    again = chunked.generate([prompt], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and first.outputs[0].token_ids == again.outputs[0].token_ids
    scored = chunked.generate([prompt], plain.clone(prompt_logprobs=1), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # the cache would have skipped positions whose logprobs are wanted
    assert len(scored.prompt_logprobs) == len(scored.prompt_token_ids)
    assert all(len(d) in (1, 2) for d in scored.prompt_logprobs[1:])
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids


def test_generation_after_the_prompt_and_n_and_deltas(tiny_llama):
    llm = LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=5, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate(["one two three four"], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 5 for c in out.outputs)
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])  # k = 0: the prompt token alone
    # Streamed deltas carry them once, with the first output.
    engine = llm.llm_engine
    engine.add_request("d", "one two three", params.clone(n=1, output_kind=RequestOutputKind.DELTA))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs is not None for o in engine.step()]
    assert seen[0] and not any(seen[1:])


def test_limits_and_scoring_only_with_prompt_logprobs(tiny_llama):
    llm = LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match="prompt_logprobs must be at most 20"):
        llm.generate(["Hi"], SamplingParams(prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="whole vocabulary"):
        llm.generate(["Hi"], SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative"):
        SamplingParams(prompt_logprobs=-2)
    # A one-token prompt has nothing to score but its (None) first position.
    out = llm.generate([[5]], SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None] and out.outputs[0].finish_reason == "length"


def test_the_whole_vocabulary_when_max_logprobs_is_lifted(tiny_llama):
    llm = LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20, max_logprobs=-1)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=0, prompt_logprobs=-1), use_tqdm=False)[0]
    vocab = llm.llm_engine.config.model_config.vocab_size
    for entry in out.prompt_logprobs[1:]:
        assert len(entry) == vocab
        assert sum(torch.tensor([lp.logprob for lp in entry.values()]).exp()).item() == pytest.approx(1.0, abs=1e-3)
