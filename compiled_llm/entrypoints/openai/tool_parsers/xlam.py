"""xLAM-style tool calls (`--tool-call-parser xlam`): a JSON array of `{"name", "arguments"}`
objects, bare or inside `<tool_call>...</tool_call>` or a ```json fence. This is the format the
bundled SmolLM2 family was taught to call tools in (its instruct data came from the xLAM/APIGen
function-calling set):

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

The content is the text before the calls. A text that starts with `[` is taken for calls until
it proves not to be (then all of it is content, as vLLM's parser does).
"""

from __future__ import annotations

from compiled_llm.entrypoints.openai.tool_parsers.base import ParsedText, ToolParser, held_back
from compiled_llm.entrypoints.openai.tool_parsers.partial_json import ScannedCall, scan_call, skip_whitespace

_OPENERS = {"<tool_call>": "</tool_call>", "```json": "```", "[TOOL_CALLS]": ""}


def scan_calls(text: str, pos: int) -> list[ScannedCall]:
    """The calls of an array (or of objects one after the other) starting at `text[pos]`."""
    calls: list[ScannedCall] = []
    pos = skip_whitespace(text, pos)
    if pos < len(text) and text[pos] == "[":
        pos += 1
    while True:
        pos = skip_whitespace(text, pos)
        while pos < len(text) and text[pos] == ",":
            pos = skip_whitespace(text, pos + 1)
        if pos >= len(text) or text[pos] == "]":
            return calls
        call = scan_call(text, pos)
        calls.append(call)
        if call.end is None or call.broken:
            return calls
        pos = call.end


class XLAMToolParser(ToolParser):
    name = "xlam"

    def parse(self, text: str, final: bool) -> ParsedText:
        found = [(text.find(opener), opener) for opener in _OPENERS]
        found = [(at, opener) for at, opener in found if at >= 0]
        if found:
            start, opener = min(found)
            closer = _OPENERS[opener]
            body_start = start + len(opener)
            end = text.find(closer, body_start) if closer else -1
            body = text[body_start:] if end < 0 else text[body_start:end]
            if not final and end < 0 and closer:
                body = body[: len(body) - held_back(body, closer)]
            return ParsedText(text[:start], scan_calls(body, 0))
        if text.lstrip().startswith("["):
            return ParsedText("", scan_calls(text, 0))
        if final:
            return ParsedText(text)
        if not text.strip():  # nothing yet but whitespace: a bare array may still come
            return ParsedText("")
        keep = len(text) - max(held_back(text, opener) for opener in _OPENERS)
        return ParsedText(text[:keep])
