"""What every reasoning parser promises: one function from the model's text so far to its
reasoning and its content so far.

As the tool-call parsers, the same `split` serves whole responses (`final=True`) and streams: a
stream's reasoning and content deltas are the differences between the splits of successive texts
(`ReasoningStreamer`), so a streamed reply always adds up to the non-streamed one. While not final,
a split holds back text that may still turn out to be a tag (a trailing `</thi`), and its reasoning
and content only ever grow.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class SplitText:
    reasoning: str | None  # None: the text has no reasoning (or none is known yet)
    content: str


class ReasoningParser(ABC):
    """Splits one model output (a parser instance is not shared between outputs)."""

    name: str = ""

    @abstractmethod
    def split(self, text: str, final: bool) -> SplitText:
        """Reasoning and content of `text`; `final`: the text is complete (hold nothing back)."""


class ReasoningStreamer:
    """Turns the text of one choice, as it grows, into reasoning deltas and the content so far
    (which a tool-call streamer may parse further)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning = ""

    def update(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning since the last update, the content so far)."""
        split = self.parser.split(text, final)
        reasoning = split.reasoning or ""
        new = reasoning[len(self.reasoning):] if reasoning.startswith(self.reasoning) else ""
        self.reasoning = reasoning if new else self.reasoning
        return new, split.content
