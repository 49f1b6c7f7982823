"""Tool calls streamed as OpenAI streams them: each call's id, type and name in its first delta,
then its arguments in pieces, as the difference between successive parses of the text so far."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from compiled_llm.entrypoints.openai.tool_parsers.base import ParsedText, is_valid_call
from compiled_llm.logger import init_logger
from compiled_llm.utils import random_uuid

logger = init_logger(__name__)

Parse = Callable[[str, bool], ParsedText]


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{random_uuid()}"  # vLLM's form


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, in a call's first delta only
    name: str | None = None
    arguments: str = ""


@dataclass
class _SentCall:
    id: str
    arguments: str = ""


class ToolCallStreamer:
    """Turns the text of one choice, as it grows, into content and tool-call deltas.

    `max_calls`: 1 when the request said `parallel_tool_calls: false` (later calls are dropped).
    `text_fallback`: a text that ends without a valid call, none of it streamed, is content after
    all (parsed output); off for constrained output, which is calls or nothing.
    """

    def __init__(self, parse: Parse, max_calls: int | None = None, text_fallback: bool = True) -> None:
        self.parse = parse
        self.max_calls = max_calls
        self.text_fallback = text_fallback
        self.content = ""
        self.calls: list[_SentCall] = []

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """(new content, new tool-call deltas) since the last update."""
        parsed = self.parse(text, final)
        if final and self.text_fallback and not self.calls and \
                not (parsed.calls and all(is_valid_call(c) for c in parsed.calls)):
            parsed = ParsedText(text)  # no call after all: it is all content (as `ToolParser.extract` says)
        content = ""
        if parsed.content.startswith(self.content):
            content = parsed.content[len(self.content) :]
            self.content = parsed.content
        deltas: list[ToolCallDelta] = []
        calls = parsed.calls if self.max_calls is None else parsed.calls[: self.max_calls]
        for index, call in enumerate(calls):
            if call.broken:
                break
            if index == len(self.calls):
                if call.name is None:
                    break  # its name comes first, or nothing of it does
                self.calls.append(_SentCall(make_tool_call_id()))
                deltas.append(ToolCallDelta(index, self.calls[index].id, call.name))
            sent = self.calls[index]
            if call.arguments.startswith(sent.arguments) and len(call.arguments) > len(sent.arguments):
                piece = call.arguments[len(sent.arguments) :]
                sent.arguments = call.arguments
                if deltas and deltas[-1].index == index:
                    deltas[-1].arguments += piece
                else:
                    deltas.append(ToolCallDelta(index, arguments=piece))
            elif not call.arguments.startswith(sent.arguments):
                logger.warning("Tool call %d's arguments changed after being streamed; the rest is dropped.", index)
        return content, deltas
