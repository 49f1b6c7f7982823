"""Beam search (vLLM's algorithm), one implementation for `LLM.beam_search` and the OpenAI server.

A step extends every live beam by one token. It asks the engine for one token of each beam, as a
request whose prompt is the whole beam, with the `2 * beam_width` most likely next tokens and their
log-probabilities (the model's raw ones, as the engine returns them): the prefix cache holds the
blocks the beams share, so a step re-prefills little more than each beam's newest block. A
candidate that ends in EOS (unless `ignore_eos`) or in one of `stop_token_ids` finishes; the
`beam_width` best of the others by cumulative log-probability live on. The search runs for
`max_tokens` steps (or until no beam lives, or with `early_stopping` until `beam_width` beams have
finished), and its result is the `beam_width` best of the finished and the live beams by
`beam_score`, best first.

`BeamSearch` never talks to the engine: it says what the next step asks for and takes what the
engine answered. `run_sync` drives it with the offline engine's batches; `BeamSearchStream` with
`AsyncLLM` requests, which run beside every other request in the batch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from compiled_llm.config import ModelConfig
from compiled_llm.outputs import CompletionOutput, Logprob, RequestOutput
from compiled_llm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # the offline LLM imports this module and never needs the server's engine client
    from compiled_llm.engine.async_llm import AsyncLLM, RequestStream


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's fields). `tokens` include the prompt, and the token that stopped the beam
    only with `include_stop_str_in_output`; `logprobs` has one entry per generated position (the
    stopping token's included), the beam's own token first in each."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # filled in the result: the decoded tokens
    finish_reason: str | None = None  # "stop" (EOS or a stop token) or "length"
    stop_reason: int | None = None  # the token that stopped it


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """vLLM's (and Hugging Face's) ranking: the cumulative log-probability over the length raised to
    `length_penalty`. As in vLLM, the length counts the prompt's tokens and not the stopping token.
    A penalty of 0 ranks by log-probability alone (short beams win); a larger one favours longer beams."""
    return cum_logprob / (length**length_penalty)


def _with_first(entry: dict[int, Logprob], token: int) -> dict[int, Logprob]:
    """The position's candidates with the beam's own token first (where the API reads it)."""
    return {token: entry[token], **{t: lp for t, lp in entry.items() if t != token}}


class BeamSearch:
    """The search for one prompt: `live` beams, the best `finished` ones, and the step to run next."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, model_config: ModelConfig,
                 num_logprobs: int = 0) -> None:
        """`num_logprobs`: the candidates each position of the result should carry, if more than the
        search reads (the OpenAI API's `logprobs`). ValueError for a search the engine cannot run."""
        room = model_config.max_model_len - len(prompt_token_ids)
        if params.max_tokens > room:
            raise ValueError(
                f"Beam search of max_tokens={params.max_tokens} after a prompt of {len(prompt_token_ids)} tokens "
                f"does not fit the maximum context length of {model_config.max_model_len} tokens: lower max_tokens "
                f"to at most {max(room, 0)}."
            )
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            self.stop_ids |= set(model_config.eos_token_ids)
        vocab = model_config.vocab_size
        self.num_candidates = min(2 * params.beam_width, vocab)  # per beam and step, as vLLM (and HF)
        k = min(max(self.num_candidates, num_logprobs), vocab)
        limit = model_config.max_logprobs
        if 0 <= limit < k:
            raise ValueError(
                f"Beam search {params.beam_width} beams wide reads the {k} most likely next tokens at each step, more "
                f"than max_logprobs ({limit}) allows: lower the beam width (n) or raise --max-logprobs."
            )
        # Greedy: the step's own sampled token is not used, only its candidates (raw logprobs, which
        # no temperature changes), and a greedy step costs the engine nothing random.
        self.step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, detokenize=False,
                                          output_kind=RequestOutputKind.FINAL_ONLY)
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.num_steps = 0
        self.num_cached_tokens = 0  # the prompt's prefix-cache hit, from the first step

    @property
    def done(self) -> bool:
        if not self.live or self.num_steps >= self.params.max_tokens:
            return True
        return self.params.early_stopping and len(self.finished) >= self.params.beam_width

    def score(self, beam: BeamSearchSequence) -> float:
        kept_stop = beam.finish_reason == "stop" and self.params.include_stop_str_in_output
        return beam_score(beam.cum_logprob, len(beam.tokens) - kept_stop, self.params.length_penalty)

    def step_prompts(self) -> list[list[int]]:
        """The prompts of the next step's requests: one per live beam."""
        return [beam.tokens for beam in self.live]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Take the step's outputs (one per live beam, in `step_prompts` order)."""
        if self.num_steps == 0 and outputs:
            self.num_cached_tokens = outputs[0].num_cached_tokens
        extended: list[tuple[float, int, int]] = []  # (cumulative logprob, beam, token)
        entries: list[dict[int, Logprob]] = []
        for i, (beam, out) in enumerate(zip(self.live, outputs)):
            completion = out.outputs[0] if out.outputs else None
            if completion is None or not completion.logprobs:  # ended without a token (aborted)
                self.finished.append(BeamSearchSequence(beam.tokens, beam.logprobs, beam.cum_logprob,
                                                        finish_reason="length"))
                entries.append({})
                continue
            entry = completion.logprobs[0]
            entries.append(entry)
            for token, lp in entry.items():
                if lp.rank is None or lp.rank > self.num_candidates:
                    continue  # beyond the candidates the search reads (asked for the API's logprobs)
                cum = beam.cum_logprob + lp.logprob
                if token in self.stop_ids:
                    tokens = beam.tokens + [token] if self.params.include_stop_str_in_output else beam.tokens
                    logprobs = beam.logprobs + [_with_first(entry, token)]
                    self.finished.append(BeamSearchSequence(tokens, logprobs, cum, finish_reason="stop",
                                                            stop_reason=token))
                else:
                    extended.append((cum, i, token))
        extended.sort(key=lambda c: -c[0])  # stable: ties keep the beams' and the candidates' order
        beams = self.live
        self.live = [
            BeamSearchSequence(beams[i].tokens + [token], beams[i].logprobs + [_with_first(entries[i], token)], cum)
            for cum, i, token in extended[: self.params.beam_width]
        ]
        # Only the best `beam_width` finished beams can be in the result.
        self.finished = sorted(self.finished, key=self.score, reverse=True)[: self.params.beam_width]
        self.num_steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The result, best first: the finished beams (only they, once `early_stopping` has ended the
        search) and the live ones, which end by length."""
        pool = list(self.finished)
        if not (self.params.early_stopping and len(self.finished) >= self.params.beam_width):
            pool += [BeamSearchSequence(b.tokens, b.logprobs, b.cum_logprob, finish_reason="length") for b in self.live]
        return sorted(pool, key=self.score, reverse=True)[: self.params.beam_width]

    def text_ids(self, beam: BeamSearchSequence) -> list[int]:
        """The beam's tokens as its text shows them: without the stopping token, as vLLM."""
        kept_stop = beam.finish_reason == "stop" and self.params.include_stop_str_in_output
        return beam.tokens[: len(beam.tokens) - kept_stop]

    def output(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The offline result: as vLLM's, each sequence's text decodes its tokens, the prompt's included."""
        sequences = self.best()
        for beam in sequences:
            beam.text = decode(self.text_ids(beam))
        return BeamSearchOutput(sequences)

    def completions(self, texts: Sequence[str]) -> list[CompletionOutput]:
        """The result as the OpenAI API's choices: the generated part of each beam, with its text."""
        result = []
        for index, (beam, text) in enumerate(zip(self.best(), texts)):
            token_ids = beam.tokens[self.prompt_len:]
            result.append(CompletionOutput(index, text, token_ids, beam.cum_logprob, beam.logprobs[: len(token_ids)],
                                           beam.finish_reason, beam.stop_reason))
        return result


def run_sync(searches: Sequence[BeamSearch],
             generate: Callable[[list[list[int]], list[SamplingParams]], list[RequestOutput]]) -> None:
    """Run searches to the end, every live beam of every search in one batch per step;
    `generate(prompts, params)` returns one finished output per prompt, in order."""
    while active := [s for s in searches if not s.done]:
        prompts = [prompt for s in active for prompt in s.step_prompts()]
        params = [s.step_params for s in active for _ in s.live]
        outputs = generate(prompts, params)
        start = 0
        for s in active:
            s.advance(outputs[start : start + len(s.live)])
            start += len(s.live)


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None
    return last


class BeamSearchStream:
    """One beam search, read as a request stream by the OpenAI handlers: iterating runs the
    search and yields one output, its beams as completions, best first. A reader cancelled (its
    client gone) aborts the step in flight, every beam's request at once, so the engine frees
    their blocks."""

    def __init__(self, engine: AsyncLLM, request_id: str, prompt: str | None, search: BeamSearch,
                 priority: int = 0) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.search = search
        self.priority = priority
        self.finished = False

    def __aiter__(self) -> "BeamSearchStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        search = self.search
        while not search.done:
            search.advance(await self._step(search.step_prompts()))
        beams = search.best()
        texts = [await self.engine.detokenize(search.text_ids(beam)[search.prompt_len:]) for beam in beams]
        self.finished = True
        return RequestOutput(self.request_id, self.prompt, search.prompt_token_ids, search.completions(texts), True,
                             search.num_cached_tokens)

    async def _step(self, prompts: list[list[int]]) -> list[RequestOutput]:
        ids = [f"{self.request_id}-{self.search.num_steps}-{i}" for i in range(len(prompts))]
        try:
            streams = [await self.engine.add_request(rid, prompt, self.search.step_params, self.priority)
                       for rid, prompt in zip(ids, prompts)]
            return list(await asyncio.gather(*(_last(s) for s in streams)))
        finally:
            await self.engine.abort(ids)  # (finished ones are ignored)
