"""Reasoning parsers, chosen with `--reasoning-parser NAME` (vLLM's names)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from compiled_llm.entrypoints.openai.reasoning_parsers.base import ReasoningParser, ReasoningStreamer, SplitText
from compiled_llm.entrypoints.openai.reasoning_parsers.think import (
    DeepSeekR1ReasoningParser,
    OpenedThinkBlockParser,
    Qwen3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}


def request_reasoning_parser(name: str | None, constrained_call: bool, structured: bool,
                             template_kwargs: dict[str, Any] | None) -> Callable[[], ReasoningParser] | None:
    """What makes the parser of each of one request's outputs, or None: no `--reasoning-parser`, or
    a call that tool_choice constrains (it has no reasoning). The request's own structured-output
    constraint shapes the whole output (vLLM's grammar would wait for the reasoning to end): then
    only a block the output opens itself is reasoning, however the flag's parser reads free text.
    `chat_template_kwargs.enable_thinking` false turns the reasoning off."""
    if not name or constrained_call:
        return None
    thinking = (template_kwargs or {}).get("enable_thinking", True) is not False
    return functools.partial(OpenedThinkBlockParser if structured else REASONING_PARSERS[name], thinking=thinking)


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStreamer", "SplitText", "request_reasoning_parser"]
