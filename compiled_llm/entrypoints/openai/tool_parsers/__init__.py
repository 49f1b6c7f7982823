"""Tool-call parsers, chosen with `--tool-call-parser NAME` (vLLM's names)."""

from __future__ import annotations

from compiled_llm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, FunctionCallText, ToolParser
from compiled_llm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from compiled_llm.entrypoints.openai.tool_parsers.streaming import ToolCallDelta, ToolCallStreamer
from compiled_llm.entrypoints.openai.tool_parsers.xlam import XLAMToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    XLAMToolParser.name: XLAMToolParser,
}

__all__ = [
    "TOOL_PARSERS", "ExtractedToolCalls", "FunctionCallText", "ToolCallDelta", "ToolCallStreamer", "ToolParser",
]
