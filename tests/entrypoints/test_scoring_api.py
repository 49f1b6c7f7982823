"""Scoring texts through the completions API, as lm-eval-harness does: `echo` with `logprobs`
(and `max_tokens` 0 or 1) gives each prompt token's logprob given the tokens before it. They must
equal the offline API's prompt logprobs and agree with HF transformers' log-likelihood of the same
text (close values, and top-5 closeness as the parity tests use)."""

from __future__ import annotations

import httpx
import pytest
import torch

from compiled_llm import LLM, SamplingParams

openai = pytest.importorskip("openai")

TIMEOUT = 600  # generous: CI machines are shared
TEXTS = ["The capital of France is Paris.", "1, 2, 3, 4, 5, 6, 7", "def add(a, b):\n    return a + b"]
TOP = 5


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def tokenize(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=TIMEOUT).json()["tokens"]


@pytest.fixture(scope="module")
def hf_logprobs(real_model_path):
    """Per text, HF's [position, vocab] log-probabilities of the next token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    model = AutoModelForCausalLM.from_pretrained(real_model_path, dtype=torch.float32).eval()
    result = []
    with torch.inference_mode():
        for text in TEXTS:
            ids = tokenizer(text)["input_ids"]
            result.append((ids, model(torch.tensor([ids])).logits[0].log_softmax(-1)))
    return result


def test_echo_logprobs_equal_offline_and_agree_with_hf(api_server, real_model_path, hf_logprobs):
    c = client(api_server)
    scored = c.completions.create(model="smol", prompt=TEXTS, max_tokens=0, echo=True, logprobs=TOP)
    llm = LLM(real_model_path, optimization_level=0, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    offline = llm.generate(TEXTS, SamplingParams(max_tokens=0, prompt_logprobs=TOP), use_tqdm=False)
    for text, choice, off, (ids, hf) in zip(TEXTS, scored.choices, offline, hf_logprobs):
        lp = choice.logprobs
        assert choice.text == text and choice.finish_reason == "length"
        assert off.prompt_token_ids == ids == tokenize(api_server, text)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
        assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
        # The first token has nothing before it: no logprob (OpenAI's and vLLM's null).
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and off.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            ours = lp.token_logprobs[i]
            assert ours == pytest.approx(off.prompt_logprobs[i][ids[i]].logprob, abs=2e-3), (text, i)
            assert ours == pytest.approx(hf[i - 1, ids[i]].item(), abs=2e-2), (text, i)
            # top-5 closeness: each side's most likely next token is among the other's top 5.
            ours_top = sorted(off.prompt_logprobs[i].items(), key=lambda kv: kv[1].rank or 0)
            ours_top = [tid for tid, p in ours_top if p.rank is not None and p.rank <= TOP]
            hf_top = hf[i - 1].topk(TOP).indices.tolist()
            assert hf_top[0] in ours_top and ours_top[0] in hf_top, (text, i, ours_top, hf_top)
            assert len(lp.top_logprobs[i]) <= TOP + 1 and lp.tokens[i] in lp.top_logprobs[i]
    # lm-eval's request: echo, logprobs 1, max_tokens 1 (the last token is generated, then dropped).
    lm_eval = c.completions.create(model="smol", prompt=TEXTS[0], max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = lm_eval.choices[0].logprobs
    assert lp.token_logprobs[:-1] == pytest.approx(scored.choices[0].logprobs.token_logprobs, abs=2e-3)
    assert len(lp.tokens) == len(hf_logprobs[0][0]) + 1 and lm_eval.usage.completion_tokens == 1


def test_prompt_logprobs_fields_and_streamed_echo(api_server):
    c = client(api_server)
    ids = tokenize(api_server, TEXTS[1])
    out = c.completions.create(model="smol", prompt=TEXTS[1], max_tokens=2, temperature=0,
                               extra_body={"prompt_logprobs": 2})
    prompt_logprobs = out.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, entry in zip(ids[1:], prompt_logprobs[1:]):
        first = next(iter(entry))
        assert int(first) == token_id and 2 <= len(entry) <= 3  # the prompt's token, then the top 2
        assert {"logprob", "rank", "decoded_token"} <= set(entry[first])
    chat = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                     extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    chat_logprobs = chat.model_extra["prompt_logprobs"]
    assert len(chat_logprobs) == len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    # Streamed, the echo comes first (with the prompt's logprobs), then the new tokens.
    whole = c.completions.create(model="smol", prompt=TEXTS[0], max_tokens=4, temperature=0, echo=True, logprobs=1)
    chunks = list(c.completions.create(model="smol", prompt=TEXTS[0], max_tokens=4, temperature=0, echo=True,
                                       logprobs=1, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    streamed = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:],
                                                                  abs=2e-3)
