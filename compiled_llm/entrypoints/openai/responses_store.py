"""The in-memory store of the Responses API: finished responses kept for `GET /v1/responses/{id}`,
`DELETE` and `previous_response_id`, each with the conversation that led to it.

Off by default, as in vLLM: then `store: true` is accepted but nothing is kept (clients send it
because it is OpenAI's default). `VLLM_ENABLE_RESPONSES_API_STORE=1` (vLLM's switch) or
`COMPILED_LLM_ENABLE_RESPONSES_API_STORE=1` turns it on.

Bounded: at most `MAX_BYTES` of JSON in all (64 MiB), the least recently used response evicted
first; a continued conversation is stored whole with each response (its items are the next
request's prefix), so a long chain of turns fills it faster than its last turns suggest. The store
lives in one API server process: with `--api-server-count` above 1, a later request may reach
another process that does not hold the response.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from compiled_llm.entrypoints.openai.responses_protocol import ResponsesResponse
from compiled_llm.logger import init_logger
from compiled_llm.utils import env_flag

logger = init_logger(__name__)

STORE_ENV_VARS = ("VLLM_ENABLE_RESPONSES_API_STORE", "COMPILED_LLM_ENABLE_RESPONSES_API_STORE")
MAX_BYTES = 64 << 20


def store_enabled() -> bool:
    return env_flag(*STORE_ENV_VARS)


@dataclass
class StoredResponse:
    response: ResponsesResponse
    conversation: list[dict[str, Any]]  # the input items before its output (instructions left out)
    size: int


class ResponsesStore:
    """Least recently used responses, up to `max_bytes` of their JSON."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponsesResponse, conversation: list[dict[str, Any]]) -> bool:
        """Keep `response`; False when it alone is over the limit (then it is not kept)."""
        size = len(response.model_dump_json()) + sum(len(repr(item)) for item in conversation)
        if size > self.max_bytes:
            logger.warning("Response %s (%d bytes) is larger than the Responses store (%d bytes): not stored.",
                           response.id, size, self.max_bytes)
            return False
        self.delete(response.id)
        self._entries[response.id] = StoredResponse(response, conversation, size)
        self.size += size
        while self.size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.size -= evicted.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.size -= entry.size
        return True
