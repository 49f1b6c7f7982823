"""`SamplingParams`: how one request is sampled and when it stops (vLLM's names and defaults).

It is a msgspec Struct so that it crosses the ZeroMQ boundary to the engine as msgpack, never
as pickle.
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Any

import msgspec

_SAMPLING_EPS = 1e-5
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on the output, enforced by a grammar engine (vLLM's names): exactly one of a
    JSON schema (`json`, as a dict or its JSON text), any JSON object (`json_object`), a regular
    expression, a list of choices, or an EBNF grammar."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # JSON (schema or object) without free whitespace between tokens: a small model cannot then
    # spend its whole budget on blank lines inside the object.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice or grammar, "
                f"got {', '.join(given) or 'none'}."
            )
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs' choice must be a non-empty list of strings.")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias, [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Logprobs of each prompt token (given the tokens before it), with this many top candidates.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's logprob_token_ids: the logprobs of these token ids at each step, in place of the top
    # `logprobs` alternatives, whatever `logprobs` says (a fixed label set, as classifiers score).
    logprob_token_ids: list[int] | None = None
    # vLLM's allowed_token_ids: sampling (greedy too) chooses among these ids only; logprobs stay
    # the model's own, computed before the restriction.
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect; normalise them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{field} {why}, got {getattr(self, field)!r}.")

        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and _INT64_MIN <= value <= _INT64_MAX):
                raise bad(name, "must be an integer within int64")
        if self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1 and not (
            self.max_tokens == 0 and self.prompt_logprobs is not None
        ):
            raise bad("max_tokens", "must be at least 1 (0 only with prompt_logprobs, to score a prompt)")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise bad("prompt_logprobs", "must be non-negative, or -1 for the whole vocabulary")
        self._verify_logit_bias()
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _INT64_MAX for t in ids):
                raise bad("logprob_token_ids", "must be a non-empty list of non-negative token ids")
            if self.logprobs is None:
                raise bad("logprobs", "must be set with logprob_token_ids")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _INT64_MAX for t in ids):
                raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or not 0 <= t <= _INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative token ids")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True.")

    def _verify_logit_bias(self) -> None:
        """Token ids are integers and biases finite numbers in [-100, 100] (OpenAI's range); that
        the ids are within the vocabulary is checked against the model by the frontend."""
        for token_id, bias in (self.logit_bias or {}).items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id!r}.")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise ValueError(f"logit_bias[{token_id}] must be a finite number, got {bias!r}.")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{token_id}] must be in [-100, 100], got {bias!r}.")

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """What needs the model to check (the frontend's Processor and the engine core both call it):
        logit_bias ids within the vocabulary, prompt_logprobs within `max_logprobs` (-1 lifts the
        limit, and only then may a request ask for the whole vocabulary with -1)."""
        bad = [t for t in self.logit_bias or {} if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias holds token id {bad[0]}, outside the vocabulary (size {vocab_size}).")
        for field in ("logprob_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, field) or () if t >= vocab_size]
            if bad:
                raise ValueError(f"{field} holds token id {bad[0]}, out of vocabulary (size {vocab_size}).")
        k = self.prompt_logprobs
        if k is not None and max_logprobs >= 0 and (k == -1 or k > max_logprobs):
            wanted = "the whole vocabulary (-1)" if k == -1 else k
            raise ValueError(
                f"prompt_logprobs must be at most {max_logprobs} (--max-logprobs; -1 lifts the limit), got {wanted}."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


class BeamSearchParams(msgspec.Struct, omit_defaults=True):
    """How `LLM.beam_search` searches (vLLM's names and defaults): the `beam_width` best sequences
    of at most `max_tokens` tokens, ranked with `length_penalty` (see entrypoints/beam_search.py).

    `temperature` is accepted as vLLM accepts it; the candidates are ranked by the model's raw
    log-probabilities (as vLLM ranks them), which no temperature changes. Beyond vLLM's fields:
    `early_stopping` (Hugging Face's `True`: stop once `beam_width` beams have finished) and
    `stop_token_ids` (tokens that end a beam as EOS does).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool = False
    stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _INT64_MAX:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}.")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}.")
        ids = self.stop_token_ids or []
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _INT64_MAX for t in ids):
            raise ValueError(f"stop_token_ids must hold non-negative token ids, got {self.stop_token_ids!r}.")
