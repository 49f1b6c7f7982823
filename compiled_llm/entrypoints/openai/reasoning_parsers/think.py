"""Reasoning in a `<think>...</think>` block at the start of the output, as Qwen3 and DeepSeek-R1
write it (vLLM's `--reasoning-parser qwen3` and `deepseek_r1`); the content is what follows.

- `qwen3`, as vLLM 0.32 reads Qwen3: the output is reasoning from its start (a `<think>` there is
  the tag, the templates of Qwen3-2507 thinking models and their successors write it into the
  prompt) until `</think>`, or until a `<tool_call>`, which begins a call from within the thought;
  an output that never closes the block is all reasoning. With `chat_template_kwargs.enable_thinking`
  false (the template wrote an empty block into the prompt) the whole output is content.
- `deepseek_r1`: reasoning from the output's start (`<think>` there or not) until `</think>`; an
  output that never closes it is all reasoning.
- `OpenedThinkBlockParser` (no flag): only a block the output opens itself is reasoning. For
  outputs that a request's own structured-output constraint shapes whole: the grammar decides
  whether a block is written at all.

A block that `max_tokens` cuts short is reasoning with no content, in each.
"""

from __future__ import annotations

from compiled_llm.entrypoints.openai.reasoning_parsers.base import ReasoningParser, SplitText
from compiled_llm.entrypoints.openai.tool_parsers.base import held_back

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"


class ThinkTagsParser(ReasoningParser):
    start_in_prompt = False  # the template may open the block: reasoning from the output's start
    ends_at_tool_call = False  # a <tool_call> ends the reasoning (and stays in the content, a call)

    def __init__(self, thinking: bool = True) -> None:
        """`thinking` false: the request turned thinking off (`enable_thinking`), all is content."""
        self.thinking = thinking

    def split(self, text: str, final: bool) -> SplitText:
        if not self.thinking:
            return SplitText(None, text)
        first = len(text) - len(text.lstrip())
        if text.startswith(THINK_START, first):
            body = first + len(THINK_START)
        elif not final and THINK_START.startswith(text[first:]):
            return SplitText(None, "")  # nothing but whitespace, or a tag that may still open: undecided
        elif self.start_in_prompt:
            body = 0
        else:
            return SplitText(None, text)
        ends = (THINK_END, TOOL_CALL_START) if self.ends_at_tool_call else (THINK_END,)
        found = [(at, tag) for tag in ends if (at := text.find(tag, body)) >= 0]
        if not found:
            reasoning = text[body:]
            if not final:
                reasoning = reasoning[: len(reasoning) - max(held_back(reasoning, tag) for tag in ends)]
            return SplitText(reasoning, "")
        end, tag = min(found)
        return SplitText(text[body:end], text[end + len(THINK_END):] if tag == THINK_END else text[end:])


class OpenedThinkBlockParser(ThinkTagsParser):
    name = "opened_think_block"


class Qwen3ReasoningParser(ThinkTagsParser):
    name = "qwen3"
    start_in_prompt = True
    ends_at_tool_call = True


class DeepSeekR1ReasoningParser(ThinkTagsParser):
    name = "deepseek_r1"
    start_in_prompt = True
