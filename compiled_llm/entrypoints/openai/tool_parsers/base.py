"""What every tool-call parser promises: one function from the model's text so far to its
content and its tool calls so far.

The same `parse` serves whole responses (`final=True`) and streams: a stream's deltas are the
differences between the parses of successive texts (see `streaming.py`), so a streamed response
always adds up to the non-streamed one. While not final, a parse holds back text that may still
turn out to open a tool call (a trailing `<tool_`), and it never takes back what it has given.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from compiled_llm.entrypoints.openai.tool_parsers.partial_json import ScannedCall


@dataclass
class ParsedText:
    content: str
    calls: list[ScannedCall] = field(default_factory=list)


@dataclass
class FunctionCallText:
    name: str
    arguments: str  # JSON text


@dataclass
class ExtractedToolCalls:
    """A finished response: the text for `content` (None if only calls) and the calls."""

    content: str | None
    calls: list[FunctionCallText]


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (to hold back
    while streaming: they may turn out to open a tool call)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def is_valid_call(call: ScannedCall) -> bool:
    if call.broken or call.name is None or not call.arguments_done or call.end is None:
        return False
    try:
        json.loads(call.arguments)
    except ValueError:
        return False
    return True


class ToolParser(ABC):
    """Parses one model output (a parser instance is not shared between outputs)."""

    name: str = ""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedText:
        """Content and calls of `text`; `final`: the text is complete (hold nothing back)."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The finished output's content and calls. If any call is not a valid call with JSON
        arguments, the model did not make a call: all of it is content (as vLLM's parsers do)."""
        parsed = self.parse(text, final=True)
        if not parsed.calls or not all(is_valid_call(c) for c in parsed.calls):
            return ExtractedToolCalls(text, [])
        calls = [FunctionCallText(c.name or "", c.arguments) for c in parsed.calls]
        return ExtractedToolCalls(parsed.content if parsed.content.strip() else None, calls)
