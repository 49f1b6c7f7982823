"""Hermes-style tool calls (`--tool-call-parser hermes`; Hermes, Qwen2.5/3 and many others): each
call is one JSON object between `<tool_call>` and `</tool_call>`, after any plain text.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

As vLLM's parser: the content is the text before the first call; a last call whose closing tag
never came (the model stopped at end-of-sequence) still counts if its JSON is whole.
"""

from __future__ import annotations

from compiled_llm.entrypoints.openai.tool_parsers.base import ParsedText, ToolParser, held_back
from compiled_llm.entrypoints.openai.tool_parsers.partial_json import scan_call, skip_whitespace

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedText:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            keep = len(text) if final else len(text) - held_back(text, TOOL_CALL_START)
            return ParsedText(text[:keep])
        parsed = ParsedText(text[:start])
        while start >= 0:
            body_start = start + len(TOOL_CALL_START)
            end = text.find(TOOL_CALL_END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            if not final and end < 0:
                body = body[: len(body) - held_back(body, TOOL_CALL_END)]
            first = skip_whitespace(body, 0)
            if first < len(body):
                parsed.calls.append(scan_call(body, first))
            if end < 0:
                break
            start = text.find(TOOL_CALL_START, end + len(TOOL_CALL_END))
        return parsed
