"""What the model runner hands back to the engine core after a step: the step's output, and the
handle of a step still running on the device (the core reads it one step later under asynchronous
scheduling). Kept here, below the core and the runner, so the core never imports the runner."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import msgspec


class LogprobsLists(msgspec.Struct, array_like=True):
    """Log probabilities of the tokens sampled in one step for one request, or of its prompt's
    tokens (it travels on to the frontend inside `EngineCoreOutput`).

    Row i: the sampled (or prompt) token first, then the top-k candidates (ranks 1..k).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_ranks: list[int]


class PooledTensor(msgspec.Struct, array_like=True):
    """One pooling request's result on its way to the frontend: float32 values, little-endian, as
    raw bytes (msgpack carries them as one binary field, not a list of floats), and their shape."""

    data: bytes
    shape: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # empty for a request still in the middle of its prompt
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Requests whose prompt was completed in this step and that asked for prompt logprobs: one row
    # per prompt token after the first.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Pooling runner: the requests whose prompt was completed in this step, and their pooled vector.
    pooler_output: dict[str, PooledTensor] = field(default_factory=dict)
    # Speculative decoding with asynchronous scheduling: requests whose draft slots the runner's
    # n-gram lookup filled only in part, and how many drafts it found (the others verified no token).
    num_proposed_drafts: dict[str, int] = field(default_factory=dict)


class AsyncModelRunnerOutput(ABC):
    """A launched step whose sampled tokens may still be on their way from the device."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """The step's output, waiting for the device if need be (the same object on every call)."""
