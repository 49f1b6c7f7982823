"""What the scheduler hands the model runner for one step: only what changed since the last one."""

from __future__ import annotations

from dataclasses import dataclass, field

from compiled_llm.lora.request import LoRARequest
from compiled_llm.pooling_params import PoolingParams
from compiled_llm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the model runner has no row for yet (new, or resumed after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt and any output generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # a pooling request's
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # rows the runner can drop
    # Rows the runner drops for now but whose sampling state (a seeded generator) it keeps:
    # the request comes back and must draw the same random numbers as if never preempted.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests with structured outputs that sample in this step: the order of the grammar
    # bitmask's rows, which the engine core fills once their previous tokens are accepted.
    structured_output_request_ids: list[str] = field(default_factory=list)
    # Speculative decoding: the draft tokens each listed request verifies in this step (its
    # num_scheduled_tokens counts them, after its one known token).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
