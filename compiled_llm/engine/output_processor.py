"""Frontend-side output handling: engine-core outputs -> `RequestOutput`s.

Detokenizes incrementally, applies stop strings (asking the engine to abort a request whose
stop string was found), builds logprobs and prompt logprobs, and gathers the `n` child requests
of a parallel sampling request into one output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from compiled_llm.engine.detokenizer import IncrementalDetokenizer
from compiled_llm.engine.tokenizer import TokenTexts
from compiled_llm.messages.engine_core import EngineCoreOutput, EngineCoreRequest
from compiled_llm.messages.runner_output import LogprobsLists
from compiled_llm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """A request with `n > 1`: its children run as separate engine requests."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.children: dict[int, CompletionOutput] = {}
        self.num_finished = 0
        self.prompt_logprobs: PromptLogprobs | None = None  # from the first child that has them
        self.prompt_logprobs_sent = False

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def child_params(self, index: int) -> SamplingParams:
        seed = self.params.seed
        if seed is not None:  # child i draws from seed + i, wrapped into int64
            seed = (seed + index + 2**63) % 2**64 - 2**63
        return self.params.clone(n=1, seed=seed)

    def child_request(self, request: EngineCoreRequest, index: int) -> EngineCoreRequest:
        """The engine request of child `index` of the user's `request`."""
        return EngineCoreRequest(
            self.child_id(index), request.prompt_token_ids, self.child_params(index),
            request.arrival_time, request.priority, request.client_index, parent_id=self.request_id,
            lora_request=request.lora_request,
        )


@dataclass
class RequestState:
    request_id: str  # the engine's id (a child's id for n > 1)
    external_id: str  # the id the user sees
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    parent: ParentRequest | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    sent_tokens: int = 0  # for DELTA outputs
    sent_logprobs: int = 0
    queue: Any = None  # the async frontend's per-request stream
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # (DELTA outputs) they go with the first output only
    pooling: bool = False  # a pooling request: one output, its pooled vector


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    reqs_to_abort: list[str]  # engine ids whose stop string was found here


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_text = TokenTexts(tokenizer)
        self.states: dict[str, RequestState] = {}
        # Hook for metrics: called with (state, finished) after each output.
        self.on_output: Callable[[RequestState, EngineCoreOutput], None] | None = None

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        external_id: str,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: Any = None,
    ) -> None:
        """One engine request's state (its ids were checked free by `add_user_request`)."""
        params = request.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params) if params.detokenize else None
        state = RequestState(
            request.request_id, external_id, index, prompt, request.prompt_token_ids, params, detok, parent,
            RequestMetrics(arrival_time=request.arrival_time), queue=queue,
        )
        state.pooling = request.pooling_params is not None
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.states[request.request_id] = state

    def add_user_request(
        self, request: EngineCoreRequest, prompt: str | None, queue: Any = None
    ) -> list[EngineCoreRequest]:
        """Register a user's request (for `n > 1`, its children) and return the engine requests to
        send. Ids already open are refused before anything is registered."""
        external_id = request.request_id
        if request.sampling_params.n == 1:
            parent, children = None, [request]
        else:
            parent = ParentRequest(external_id, request.sampling_params)
            children = [parent.child_request(request, index) for index in range(parent.n)]
        self.check_ids_free([child.request_id for child in children])
        for index, child in enumerate(children):
            self.add_request(child, prompt, external_id, parent, index, queue=queue)
        return children

    def check_ids_free(self, engine_ids: list[str]) -> None:
        """Refuse ids an open request already uses (a user's id can equal another request's
        child id): two requests under one engine id would mix their outputs."""
        for engine_id in engine_ids:
            if engine_id in self.states:
                raise ValueError(f"Request id {engine_id!r} is already in use by an open request.")

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns the engine ids that were still open."""
        return [rid for rid in request_ids if self.states.pop(rid, None) is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        request_outputs: list[RequestOutput | PoolingRequestOutput] = []
        to_abort: list[str] = []
        now = time.time()
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted here while the engine was still producing
            if state.pooling:
                self._pooling_output(state, out, now, request_outputs)
                continue
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            new_ids = out.new_token_ids
            if state.detokenizer is not None and new_ids:
                stop, used = state.detokenizer.update(new_ids, stop_terminated=finish_reason == "stop")
                if stop is not None:
                    new_ids = new_ids[:used]
                    if finish_reason is None:
                        to_abort.append(out.request_id)
                    finish_reason, stop_reason = "stop", stop
            state.token_ids.extend(new_ids)
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_logprobs is not None and state.logprobs is not None:
                self._append_logprobs(state, out.new_logprobs, len(new_ids))
            holder = state.parent or state
            if out.new_prompt_logprobs is not None and holder.prompt_logprobs is None:
                # (A recomputed prompt may send them twice: the first stays.)
                holder.prompt_logprobs = [None, *self._logprob_dicts(out.new_prompt_logprobs)]
            m = state.metrics
            if new_ids:
                m.first_token_time = m.first_token_time or now
                m.last_token_time = now
            finished = finish_reason is not None
            if finished:
                m.finished_time = now
                del self.states[out.request_id]
            if self.on_output is not None:
                self.on_output(state, out)
            if finish_reason == "error" and state.queue is not None:
                # The engine refused the request: its reader gets the reason as an error.
                state.queue.put(ValueError(str(stop_reason)))
                continue
            result = self._make_output(state, finish_reason, stop_reason)
            if result is not None:
                if state.queue is not None:
                    state.queue.put(result)
                else:
                    request_outputs.append(result)
        return ProcessedOutputs(request_outputs, to_abort)

    def _pooling_output(self, state: RequestState, out: EngineCoreOutput, now: float,
                        request_outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        """A pooling request ends with its one output: the vector, or the reason it has none."""
        if not out.finished:
            return
        state.num_cached_tokens = out.num_cached_tokens
        state.metrics.finished_time = now
        del self.states[out.request_id]
        if self.on_output is not None:
            self.on_output(state, out)
        if out.pooling_output is None:  # refused by the engine, or aborted before its prompt was pooled
            why = out.stop_reason if out.finish_reason == "error" else "The request was aborted before it was pooled."
            if state.queue is not None:
                state.queue.put(ValueError(str(why)))
            return
        pooled = out.pooling_output
        data = torch.frombuffer(bytearray(pooled.data), dtype=torch.float32).reshape(pooled.shape)
        result = PoolingRequestOutput(state.external_id, PoolingOutput(data), state.prompt_token_ids, True,
                                      state.num_cached_tokens, state.prompt)
        if state.queue is not None:
            state.queue.put(result)
        else:
            request_outputs.append(result)

    def _append_logprobs(self, state: RequestState, lists: LogprobsLists, num_tokens: int) -> None:
        entries = self._logprob_dicts(lists, num_tokens)
        state.logprobs.extend(entries)  # type: ignore[union-attr]
        state.cumulative_logprob += sum(lps[0] for lps in lists.logprobs[: len(entries)])  # type: ignore[operator]

    def _logprob_dicts(self, lists: LogprobsLists, limit: int | None = None) -> list[dict[int, Logprob]]:
        """One dict per row: the sampled (or prompt) token first with its rank, then the top
        candidates not already in it (ranks 1..k)."""
        dicts = []
        for ids, lps, rank in list(zip(lists.token_ids, lists.logprobs, lists.sampled_ranks))[:limit]:
            entry: dict[int, Logprob] = {ids[0]: Logprob(lps[0], rank, self.token_text(ids[0]))}
            for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, r, self.token_text(tid))
            dicts.append(entry)
        return dicts

    def _completion(self, state: RequestState, finish_reason: str | None, stop_reason: Any) -> CompletionOutput:
        finished = finish_reason is not None
        delta = state.params.output_kind == RequestOutputKind.DELTA
        text = state.detokenizer.get_next_output_text(finished, delta) if state.detokenizer else ""
        if delta:
            token_ids = state.token_ids[state.sent_tokens :]
            logprobs = state.logprobs[state.sent_logprobs :] if state.logprobs is not None else None
            state.sent_tokens = len(state.token_ids)
            state.sent_logprobs = len(state.logprobs or [])
        else:
            token_ids, logprobs = list(state.token_ids), (list(state.logprobs) if state.logprobs is not None else None)
        return CompletionOutput(
            state.index, text, token_ids, state.cumulative_logprob, logprobs, finish_reason, stop_reason
        )

    def _make_output(self, state: RequestState, finish_reason: str | None, stop_reason: Any) -> RequestOutput | None:
        finished = finish_reason is not None
        kind = state.params.output_kind
        parent = state.parent
        if parent is None:
            if kind == RequestOutputKind.FINAL_ONLY and not finished:
                return None
            completion = self._completion(state, finish_reason, stop_reason)
            return self._request_output(state, [completion], finished)
        # n > 1: one output gathering the children.
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._completion(state, finish_reason, stop_reason)
        parent.children[state.index] = completion
        if finished:
            parent.num_finished += 1
        all_done = parent.num_finished == parent.n
        if kind == RequestOutputKind.DELTA:
            return self._request_output(state, [completion], all_done)
        if kind == RequestOutputKind.FINAL_ONLY and not all_done:
            return None
        ordered = [parent.children[i] for i in sorted(parent.children)]
        return self._request_output(state, ordered, all_done)

    @staticmethod
    def _request_output(state: RequestState, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        holder = state.parent or state
        prompt_logprobs = holder.prompt_logprobs
        if state.params.output_kind == RequestOutputKind.DELTA:
            if holder.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                holder.prompt_logprobs_sent = True
        return RequestOutput(
            state.external_id, state.prompt, state.prompt_token_ids, outputs, finished,
            state.num_cached_tokens, state.metrics, prompt_logprobs,
        )
