"""What `LLM.generate` and `AsyncLLM.generate` hand back (vLLM's names and fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only as a type: importing this module (the chat template workers do) needs no torch
    import torch


@dataclass
class Logprob:
    """One candidate token's log probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob, the sampled token first.
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt position: None for the first token (nothing precedes it), then the prompt's token
# first and the top candidates after it.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Fold a later output of the same request into this one (a slow reader gets one output).

        `aggregate`: the outputs are deltas (append their text, tokens and logprobs); otherwise
        each completion of `next_output` replaces the one with the same index.
        """
        for completion in next_output.outputs:
            mine = next((c for c in self.outputs if c.index == completion.index), None)
            if mine is None:
                self.outputs.append(completion)
            elif aggregate:
                mine.text += completion.text
                mine.token_ids = mine.token_ids + completion.token_ids
                if completion.logprobs is not None:
                    mine.logprobs = (mine.logprobs or []) + completion.logprobs
                mine.cumulative_logprob = completion.cumulative_logprob
                mine.finish_reason = completion.finish_reason
                mine.stop_reason = completion.stop_reason
            else:
                self.outputs[self.outputs.index(mine)] = completion
        self.finished = next_output.finished
        if self.prompt_logprobs is None:  # sent once (with the first output, for deltas)
            self.prompt_logprobs = next_output.prompt_logprobs
        self.num_cached_tokens = next_output.num_cached_tokens
        self.metrics = next_output.metrics



@dataclass
class PoolingOutput:
    """A pooling request's result: its pooled vector (float32)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """What `LLM.encode` and a pooling engine hand back (vLLM's name and fields)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        if output.data.dim() != 1:
            raise ValueError(f"An embedding is one vector; this output has shape {tuple(output.data.shape)}.")
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` hands back: `outputs.embedding`, a list of floats."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput.from_base(output.outputs), output.prompt_token_ids,
                   output.finished)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` hands back: `outputs.score` for one pair of texts."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # both texts' tokens
    finished: bool
