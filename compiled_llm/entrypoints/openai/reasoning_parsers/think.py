"""Reasoning between `<think>` and `</think>` at the start of the output, as Qwen3 and DeepSeek-R1
write it (vLLM's `--reasoning-parser qwen3` and `deepseek_r1`); the content is what follows `</think>`.

- `qwen3`: the output opens the block itself (`<think>`, after any whitespace); an output that
  does not is all content (Qwen3 with `enable_thinking: false`, whose template writes an empty
  block into the prompt).
- `deepseek_r1`: the chat template may have opened the block in the prompt, so the output is
  reasoning from its start (`<think>` there or not) until `</think>`; an output that never closes
  it is all reasoning.

A block that `max_tokens` cuts short is reasoning with no content, in both.
"""

from __future__ import annotations

from compiled_llm.entrypoints.openai.reasoning_parsers.base import ReasoningParser, SplitText
from compiled_llm.entrypoints.openai.tool_parsers.base import held_back

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkTagsParser(ReasoningParser):
    start_in_prompt = False  # the template may open the block: reasoning from the output's start

    def split(self, text: str, final: bool) -> SplitText:
        first = len(text) - len(text.lstrip())
        if text.startswith(THINK_START, first):
            body = first + len(THINK_START)
        elif not final and THINK_START.startswith(text[first:]):
            return SplitText(None, "")  # nothing but whitespace, or a tag that may still open: undecided
        elif self.start_in_prompt:
            body = 0
        else:
            return SplitText(None, text)
        end = text.find(THINK_END, body)
        if end < 0:
            reasoning = text[body:]
            if not final:
                reasoning = reasoning[: len(reasoning) - held_back(reasoning, THINK_END)]
            return SplitText(reasoning, "")
        return SplitText(text[body:end], text[end + len(THINK_END):])


class Qwen3ReasoningParser(ThinkTagsParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ThinkTagsParser):
    name = "deepseek_r1"
    start_in_prompt = True
