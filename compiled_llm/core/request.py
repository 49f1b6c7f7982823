"""One request's state inside the engine core: its tokens, progress, blocks' hashes and status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from compiled_llm.core.block_hash import BlockHash, hash_block_tokens
from compiled_llm.lora.request import LoRARequest
from compiled_llm.pooling_params import PoolingParams
from compiled_llm.sampling_params import SamplingParams
from compiled_llm.spec_decode.backoff import AcceptanceBackoff
from compiled_llm.spec_decode.ngram import NgramIndex

if TYPE_CHECKING:
    from compiled_llm.core.structured_outputs.grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Finished states: everything from here on.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        block_size: int,
        arrival_time: float | None = None,
        priority: int = 0,
        parent_id: str = "",
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        # A pooling request: finished once its prompt is computed, with the pooled vector and no token.
        self.pooling_params = pooling_params
        # Requests with one parent (the samples of an `n > 1` request) share the running slots of one.
        self.group = parent_id or request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.max_tokens = sampling_params.max_tokens
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.first_scheduled_time: float | None = None  # wall time of first admission, until reported
        self.num_preemptions = 0
        # Asynchronous scheduling: tokens sampled by steps still in flight, whose ids the host
        # does not know yet (the next step computes them from the device's copy).
        self.num_output_placeholders = 0
        # Of those, the draft slots of verification steps in flight: each may or may not become a
        # token (the scheduler counts them as accepted until the output says how many were).
        self.num_draft_placeholders = 0
        # Structured outputs: the matcher every accepted token advances (set once compiled).
        self.grammar: RequestGrammar | None = None
        # Speculative decoding (ngram): the index of its tokens, made when first asked for drafts.
        self.ngram: NgramIndex | None = None
        self.spec_backoff = AcceptanceBackoff()
        self.block_size = block_size
        self.lora_request = lora_request
        # Blocks computed under an adapter are its own: its key joins every block's hash.
        self._hash_extra_keys = lora_request.cache_key() if lora_request is not None else b""
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def skips_prefix_cache(self) -> bool:
        """Prompt logprobs and per-token embeddings need every prompt position computed: cached
        blocks would skip some."""
        return self.sampling_params.prompt_logprobs is not None or (
            self.pooling_params is not None and self.pooling_params.task == "token_embed")

    @property
    def may_speculate(self) -> bool:
        """Drafts are verified exactly only where a token's distribution depends on the tokens before
        it through the model (and a grammar, whose bitmask is filled for every verified position)
        alone: not with penalties (counts of earlier outputs); scoring a prompt (max_tokens=0)
        generates nothing to propose."""
        params = self.sampling_params
        return (params.max_tokens != 0 and not params.presence_penalty and not params.frequency_penalty
                and params.repetition_penalty == 1.0)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.ngram is not None:
            self.ngram.extend([token_id])
        if self.num_tokens % self.block_size == 0:
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Hash every newly full block, chained on the previous block's hash."""
        size = self.block_size
        for start in range(len(self.block_hashes) * size, self.num_tokens - size + 1, size):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block_tokens(parent, self.all_token_ids[start : start + size],
                                                       self._hash_extra_keys))
