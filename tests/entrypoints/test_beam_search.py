"""Beam search (`LLM.beam_search`, `use_beam_search` in both OpenAI APIs) against an exhaustive
search, on a random-weight model whose vocabulary has six tokens.

With `beam_width` at least the number of live prefixes (every sequence of `max_tokens - 1` tokens
that no stop token ended) and `2 * beam_width` at least the vocabulary, no candidate is ever
pruned, so beam search must return exactly the best `beam_width` of every possible sequence: the
ones a stop token ended and the ones `max_tokens` long. The exhaustive scores come from Hugging
Face's forward of the same weights, ranked by vLLM's formula stated anew here: the cumulative
log-probability over (prompt tokens + generated tokens, the stopping token not counted) raised to
`length_penalty`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import time

import httpx
import pytest
import torch
from remote_server import RemoteServer

from compiled_llm.entrypoints.beam_search import BeamSearch
from compiled_llm.models.dummy import write_dummy_model
from compiled_llm.sampling_params import BeamSearchParams
from tests.conftest import TINY_COMMON

openai = pytest.importorskip("openai")

VOCAB = 6  # <unk> <s> </s> w3 w4 w5
EOS = 2
PROMPT = [3]  # one token: the length penalty counts the prompt, so a short one lets it bite
TIMEOUT = 60
TOL = 1e-4  # ours against HF's float32 forward


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-vocab")
    write_dummy_model(folder, {"vocab_size": VOCAB, "eos_token_id": EOS})  # its word-level tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, rope_theta=10000.0, **TINY_COMMON)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_path):
    from compiled_llm import LLM

    return LLM(model_path, optimization_level=0, max_model_len=64, kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    server = RemoteServer([model_path, "-O0", "--max-model-len", "512", "--kv-cache-memory-bytes", str(16 << 20),
                           "--served-model-name", "tiny", "--chat-template", str(template)])
    yield server
    server.stop()


def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


@dataclasses.dataclass(frozen=True)
class Ranked:
    score: float
    tokens: tuple[int, ...]  # generated, the stopping token included
    finish_reason: str
    cum_logprob: float


def score(cum_logprob: float, num_generated: int, finish_reason: str, length_penalty: float) -> float:
    length = len(PROMPT) + num_generated - (finish_reason == "stop")
    return cum_logprob / length**length_penalty


def exhaustive(hf_model, max_tokens: int, length_penalty: float, stop_ids: set[int]) -> list[Ranked]:
    """Every sequence beam search could return, best first."""
    free = [t for t in range(VOCAB) if t not in stop_ids]
    prefixes = list(itertools.product(free, repeat=max_tokens - 1))
    with torch.no_grad():
        rows = hf_model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits.log_softmax(-1)
    dist = {p[:j]: row[len(PROMPT) - 1 + j].tolist() for row, p in zip(rows, prefixes) for j in range(max_tokens)}
    found: list[Ranked] = []

    def walk(prefix: tuple[int, ...], cum: float) -> None:
        for token, lp in enumerate(dist[prefix]):
            tokens = prefix + (token,)
            if token in stop_ids or len(tokens) == max_tokens:
                finish = "stop" if token in stop_ids else "length"
                found.append(Ranked(score(cum + lp, len(tokens), finish, length_penalty), tokens, finish, cum + lp))
            else:
                walk(tokens, cum + lp)

    walk((), 0.0)
    return sorted(found, key=lambda r: -r.score)


def assert_exhaustive(got: list[tuple[tuple[int, ...], str, float]], want: list[Ranked], width: int) -> None:
    """`got` (tokens, finish reason, cumulative logprob), best first, is the top `width` of `want`:
    the same scores in the same order, each sequence's own (up to float noise between the two
    forwards, which could only swap sequences whose scores tie within it)."""
    by_tokens = {r.tokens: r for r in want}
    assert len(got) == min(width, len(want))
    assert len({tokens for tokens, _, _ in got}) == len(got)
    for (tokens, finish, cum), best in zip(got, want):
        mine = by_tokens[tokens]
        assert finish == mine.finish_reason, tokens
        assert cum == pytest.approx(mine.cum_logprob, abs=TOL), tokens
        assert mine.score == pytest.approx(best.score, abs=TOL), (tokens, best.tokens)


def offline(llm, params: BeamSearchParams) -> list[tuple[tuple[int, ...], str, float]]:
    (result,) = llm.beam_search([PROMPT], params)
    got = []
    for seq in result.sequences:
        tokens = seq.tokens[len(PROMPT):]
        if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
            tokens = tokens + [seq.stop_reason]
        got.append((tuple(tokens), seq.finish_reason, seq.cum_logprob))
    return got


# ---- offline ----------------------------------------------------------------------------------
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_offline_equals_exhaustive_search(llm, hf_model, length_penalty):
    width = (VOCAB - 1) ** 2  # every live prefix of 2 tokens
    params = BeamSearchParams(beam_width=width, max_tokens=3, length_penalty=length_penalty)
    assert_exhaustive(offline(llm, params), exhaustive(hf_model, 3, length_penalty, {EOS}), width)


def test_length_penalty_changes_the_ranking_as_the_formula_says(llm, hf_model):
    short = offline(llm, BeamSearchParams(beam_width=25, max_tokens=3, length_penalty=0.0))
    long = offline(llm, BeamSearchParams(beam_width=25, max_tokens=3, length_penalty=2.5))
    # By log-probability alone a stop at once beats any longer sequence; dividing by a power of
    # the length favours length: a three-token sequence comes first.
    assert len(short[0][0]) < len(long[0][0]) == 3
    assert [t for t, _, _ in short] != [t for t, _, _ in long]


def test_stop_tokens_ignore_eos_and_the_stopping_token_in_the_output(llm, hf_model):
    params = BeamSearchParams(beam_width=16, max_tokens=3, stop_token_ids=[5], include_stop_str_in_output=True)
    got = offline(llm, params)
    assert_exhaustive(got, exhaustive(hf_model, 3, 1.0, {EOS, 5}), 16)
    (result,) = llm.beam_search([PROMPT], params)
    stopped = [s for s in result.sequences if s.finish_reason == "stop"]
    assert {s.stop_reason for s in stopped} == {EOS, 5}
    for seq in stopped:  # the token is in `tokens` (include_stop_str_in_output), never in the text
        assert seq.tokens[-1] == seq.stop_reason
        assert seq.text == llm.get_tokenizer().decode(seq.tokens[:-1])
    got = offline(llm, BeamSearchParams(beam_width=10, max_tokens=2, ignore_eos=True))
    assert_exhaustive(got, exhaustive(hf_model, 2, 1.0, set()), 10)
    assert {finish for _, finish, _ in got} == {"length"}


def test_early_stopping_ends_at_beam_width_finished_beams(llm):
    (result,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=40, early_stopping=True))
    assert [s.finish_reason for s in result.sequences] == ["stop", "stop"]
    assert all(len(s.tokens) < len(PROMPT) + 40 for s in result.sequences)


def test_offline_refuses_bad_params(llm):
    for kwargs in (dict(beam_width=0, max_tokens=3), dict(beam_width=2, max_tokens=0),
                   dict(beam_width=2, max_tokens=3, temperature=-1.0),
                   dict(beam_width=2, max_tokens=3, length_penalty=float("inf"))):
        with pytest.raises(ValueError, match="beam_width|max_tokens|temperature|length_penalty"):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match="maximum context length of 64"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=64))
    config = dataclasses.replace(llm.llm_engine.config.model_config, max_logprobs=3)
    with pytest.raises(ValueError, match="max_logprobs"):
        BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=3), config)


# ---- the server -------------------------------------------------------------------------------
def test_completions_equal_exhaustive_search_best_first(server, llm, hf_model):
    width = 25
    response = client(server).completions.create(
        model="tiny", prompt=PROMPT, n=width, max_tokens=3, logprobs=1,
        extra_body=dict(use_beam_search=True, include_stop_str_in_output=True, return_token_ids=True),
    )
    choices = sorted(response.choices, key=lambda c: c.index)
    got = [(tuple(c.token_ids), c.finish_reason, sum(c.logprobs.token_logprobs)) for c in choices]
    assert_exhaustive(got, exhaustive(hf_model, 3, 1.0, {EOS}), width)
    same = offline(llm, BeamSearchParams(width, 3, include_stop_str_in_output=True))
    assert [g[:2] for g in got] == [o[:2] for o in same]  # the offline API's beams, in its order
    assert [g[2] for g in got] == pytest.approx([o[2] for o in same], abs=1e-5)
    for c in choices:
        assert c.stop_reason == (EOS if c.finish_reason == "stop" else None)
    # Usage as vLLM counts it: the prompt once, the tokens of every beam returned.
    assert response.usage.prompt_tokens == len(PROMPT)
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in choices)


def test_several_prompts_are_searched_each(server):
    """As vLLM's own test: two copies of a prompt, two beams each, the choices prompt by prompt."""
    response = client(server).completions.create(model="tiny", prompt=[PROMPT, PROMPT], n=2, max_tokens=3,
                                                 extra_body=dict(use_beam_search=True))
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[:2] == texts[2:] and texts[0] != texts[1]
    assert response.usage.prompt_tokens == 2 * len(PROMPT)


def test_chat_beam_search_streamed_and_not(server):
    c = client(server)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "w3"}], n=3, max_tokens=4,
                  extra_body=dict(use_beam_search=True))
    full = c.chat.completions.create(**kwargs)
    texts = [ch.message.content for ch in sorted(full.choices, key=lambda ch: ch.index)]
    completion = c.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=4,
                                      extra_body=dict(use_beam_search=True))
    assert texts == [ch.text for ch in sorted(completion.choices, key=lambda ch: ch.index)]
    assert full.usage.prompt_tokens == 1 and full.usage.completion_tokens == completion.usage.completion_tokens
    streamed, finish = ["", "", ""], [None, None, None]
    for chunk in c.chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    assert streamed == texts
    assert finish == [ch.finish_reason for ch in sorted(full.choices, key=lambda ch: ch.index)]


@pytest.mark.parametrize(("body", "words"), [
    (dict(stream=True), "Streaming is not currently supported with beam search"),
    (dict(n=0), "n must be"),
    (dict(n=129), "--max-n"),
    (dict(max_tokens=600), "maximum context length"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.5), "`top_p` is not supported with use_beam_search"),
    (dict(stop=["w4"]), "`stop` is not supported with use_beam_search"),
    (dict(response_format={"type": "json_object"}), "Structured outputs"),
    (dict(use_beam_search=False, length_penalty=2.0), "apply to beam search only"),
])
def test_bad_beam_search_requests_are_400(server, body, words):
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                          extra_body=dict(dict(use_beam_search=True, n=2), **body))


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^compiled_llm:{name} (\S+)$", text, re.MULTILINE))


def test_beams_run_beside_other_requests_and_a_disconnect_aborts_them_all(server):
    finished = 'request_success_total{[^}]*}'  # engine requests, a beam's one-token steps included
    c = client(server)

    async def main() -> None:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        search = asyncio.ensure_future(ac.completions.create(
            model="tiny", prompt=PROMPT, n=4, max_tokens=500, extra_body=dict(use_beam_search=True, ignore_eos=True),
        ))
        deadline = time.monotonic() + TIMEOUT
        while await asyncio.to_thread(metric, server, finished) < before + 8:  # two steps of its 4 beams are done
            assert time.monotonic() < deadline and not search.done()
        other = await ac.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, extra_body=dict(ignore_eos=True))
        assert other.usage.completion_tokens == 5
        assert not search.done()  # 500 steps: it runs on beside the request that came and finished
        search.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await search

    before = metric(server, finished)
    asyncio.run(main())
    # The search stops: a request of 5 engine steps sees no beam step finish beside it.
    deadline = time.monotonic() + 20
    while True:
        settled = metric(server, finished)
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, extra_body=dict(ignore_eos=True))
        if metric(server, finished) == settled + 1:
            break
        assert time.monotonic() < deadline, "the beams still run after their client went away"
    assert settled - before < 4 * 500  # cut short: 500 steps of 4 beams would be 2000 requests
    assert metric(server, "num_requests_running{[^}]*}") == 0 and metric(server, "kv_cache_usage_perc{[^}]*}") == 0
