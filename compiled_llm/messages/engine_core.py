"""Messages between the frontend and the engine core.

msgspec Structs, encoded as msgpack on the wire: a peer can send data, never code (no pickle).
"""

from __future__ import annotations

import enum

import msgspec

from compiled_llm.lora.request import LoRARequest
from compiled_llm.messages.runner_output import LogprobsLists, PooledTensor
from compiled_llm.pooling_params import PoolingParams
from compiled_llm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    # Which of several API server processes sent it (`serve --api-server-count`): its outputs go
    # back to that one.
    client_index: int = 0
    # The user's request whose `n > 1` samples this is one of ("" for a request of its own): the
    # scheduler keeps one request's samples from taking every running slot.
    parent_id: str = ""
    # A pooling request (the pooling runner serves only these): its prompt is pooled, nothing sampled.
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Once, with the request's first token: the logprobs of its prompt tokens after the first.
    new_prompt_logprobs: LogprobsLists | None = None
    # Once, with the first output: when the request was first scheduled (wall time; the frontend's
    # queue, prefill and decode time metrics are measured from it).
    scheduled_time: float = 0.0
    # How many times the request has been preempted so far (sent once it has been: 0 is left out).
    num_preemptions: int = 0
    pooling_output: PooledTensor | None = None  # a pooling request's result, with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    """Speculative decoding since the last stats: vLLM's counters."""

    num_drafts: int = 0  # verifications (a request with at least one draft token in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []  # [num_speculative_tokens]: accepted at draft position i

    def observe(self, num_draft_tokens: int, num_accepted: int, num_positions: int) -> None:
        if len(self.num_accepted_tokens_per_pos) < num_positions:
            self.num_accepted_tokens_per_pos += [0] * (num_positions - len(self.num_accepted_tokens_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Of the waiting requests, those held back by a rule rather than by the lack of room: the samples
    # of an n > 1 request whose group holds its share of the running slots (vLLM's reason "deferred").
    num_waiting_deferred: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # newly scheduled prompt tokens since the last stats
    num_generation_tokens: int = 0
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding on


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Replies to utility calls: (call id, result, error message)
    utility_output: tuple[int, object, str | None] | None = None
    engine_dead: bool = False
    engine_index: int = 0  # which engine of a data-parallel group sent it


class RequestType(bytes, enum.Enum):
    """First frame of every message to the engine core."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class Handshake(msgspec.Struct, omit_defaults=True):
    """The engine core's one message at start-up (on its start-up pipe, or a Ray actor's return
    value): ready, or the start-up error in words."""

    ok: bool
    error: str | None = None
    num_blocks: int = 0
    load_seconds: float = 0.0  # model weights
    kv_seconds: float = 0.0  # KV-cache sizing and allocation
    startup_seconds: float = 0.0  # the whole EngineCore construction, compile or warm-up included
    capture_seconds: float = 0.0  # of which CUDA-graph capture (GPU, -O2)


class UtilityRequest(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list = []
    client_index: int = 0  # the API server process that waits for the answer
