"""Reasoning parsers, chosen with `--reasoning-parser NAME` (vLLM's names)."""

from __future__ import annotations

from compiled_llm.entrypoints.openai.reasoning_parsers.base import ReasoningParser, ReasoningStreamer, SplitText
from compiled_llm.entrypoints.openai.reasoning_parsers.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStreamer", "SplitText"]
