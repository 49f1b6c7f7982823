"""The frontend's cost of one streamed event, per token per client: the chunk built as the pydantic
response model and dumped (how the server encoded events before), against the dict encoded by
msgspec (`compiled_llm/entrypoints/openai/stream_events.py`, what it does now). Both give the same
bytes (tests/entrypoints/test_stream_events.py).

    python benchmarks/stream_events.py
"""

from __future__ import annotations

import statistics
import timeit

from machine import format_machine, machine_report

from compiled_llm.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaMessage,
)
from compiled_llm.entrypoints.openai.serving_engine import sse
from compiled_llm.entrypoints.openai.stream_events import (
    chat_choice,
    chat_chunk,
    completion_choice,
    completion_chunk,
    content_delta,
)


def pydantic_chat() -> str:
    return sse(ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content=" token"))]))


def msgspec_chat() -> str:
    return chat_chunk("chatcmpl-1", 1700000000, "m", [chat_choice(0, content_delta(" token"))])


def pydantic_completion() -> str:
    return sse(CompletionResponse(id="cmpl-1", created=1700000000, model="m", choices=[
        CompletionResponseChoice(index=0, text=" token")]))


def msgspec_completion() -> str:
    return completion_chunk("cmpl-1", 1700000000, "m", [completion_choice(0, " token")])


def per_call_us(fn, number: int = 20000, repeat: int = 5) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    print(format_machine(machine_report(1)))
    assert pydantic_chat() == msgspec_chat() and pydantic_completion() == msgspec_completion()
    for kind, before, after in (("chat chunk", pydantic_chat, msgspec_chat),
                                ("completion chunk", pydantic_completion, msgspec_completion)):
        b, a = per_call_us(before), per_call_us(after)
        print(f"{kind:>17}: pydantic {b:6.2f} us, msgspec {a:5.2f} us per event ({b / a:.1f}x less)")


if __name__ == "__main__":
    main()
