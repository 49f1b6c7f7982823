"""Admission control of the async frontend: vLLM's `--max-num-queued-reqs` and
`--max-num-queued-tokens`.

Without a limit, a server under more load than it can serve queues every request, and each waits
longer than its client will; with one, a request over the limit is refused at once with a 503
(`EngineBusyError`), so that a load balancer or the client's retry sends it elsewhere while the
requests already admitted keep their latency.

- `max_num_queued_reqs`: the most sequences in flight (waiting or running; a request of n samples
  counts n), the new request's included.
- `max_num_queued_tokens`: a new request is refused while the prompts still in prefill (no output
  yet) hold this many tokens or more: a bound on the time to first token. A prompt counts whole
  until its first output, however much of it a chunked prefill has computed.

Both count the requests of this API server process: with `--api-server-count N`, each of the N
processes admits up to the limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compiled_llm.engine.output_processor import RequestState

ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
_MESSAGES = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. Please try again later "
                           "or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. Please try again later or on "
                             "a different instance.",
}


class EngineBusyError(RuntimeError):
    """A request refused at admission; the server answers 503 (vLLM's words), a retryable status."""

    def __init__(self, reason: str) -> None:
        super().__init__(_MESSAGES[reason])
        self.reason = reason


@dataclass(frozen=True)
class AdmissionLimits:
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ADMISSION_REASONS:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")

    def check(self, in_flight: Mapping[str, RequestState], n: int, admitting: int = 0) -> None:
        """Raise EngineBusyError when a request of `n` sequences may not join `in_flight` (the
        frontend's requests, one per sequence) and the `admitting` sequences admitted already but
        not yet among them (still being tokenized)."""
        if self.max_num_queued_reqs is not None and len(in_flight) + admitting + n > self.max_num_queued_reqs:
            raise EngineBusyError("max_num_queued_reqs")
        if self.max_num_queued_tokens is not None:
            backlog = sum(len(state.prompt_token_ids) for state in in_flight.values() if not state.token_ids)
            if backlog >= self.max_num_queued_tokens:
                raise EngineBusyError("max_num_queued_tokens")
