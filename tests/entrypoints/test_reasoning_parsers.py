"""The reasoning parsers: `<think>` blocks split from the content, whole or streamed, a streamed
text split at every position adding up to the whole (Hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStreamer

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


@pytest.mark.parametrize("parser, text, reasoning, content", [
    (QWEN3, "<think>Let me see.</think>\n\nParis.", "Let me see.", "\n\nParis."),
    (QWEN3, "\n<think>a</think>b", "a", "b"),
    (QWEN3, "Paris.", None, "Paris."),  # no block: all content
    (QWEN3, "Paris.</think>", None, "Paris.</think>"),  # a block qwen3 did not open is no block
    (QWEN3, "<think>cut short", "cut short", ""),  # max_tokens inside the block
    (QWEN3, "<think></think>", "", ""),
    (R1, "<think>a</think>b", "a", "b"),
    (R1, "opened by the template</think>answer", "opened by the template", "answer"),
    (R1, "never closed", "never closed", ""),
    (R1, "", "", ""),
])
def test_whole_outputs(parser, text, reasoning, content):
    split = parser().split(text, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_partial_tags_are_held_back_while_streaming():
    assert QWEN3().split("<thi", final=False).content == ""  # may still open a block
    assert QWEN3().split("<thi", final=True).content == "<thi"
    assert QWEN3().split("<think>abc</thi", final=False).reasoning == "abc"
    assert R1().split("abc</", final=False).reasoning == "abc"


# Texts made of the pieces that matter (tags, their fragments, whitespace) and plain words.
PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", "</thi", "nk>", ">", "\n", " ", "a",
                          "Paris", "é", "<tool_call>"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=12), name=st.sampled_from(sorted(REASONING_PARSERS)), data=st.data())
def test_streaming_adds_up_to_the_whole_at_every_split(pieces, name, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    parser = REASONING_PARSERS[name]
    whole = parser().split(text, final=True)
    streamer = ReasoningStreamer(parser())
    reasoning, content = "", ""
    for cut in [*cuts, len(text)]:
        final = cut == len(text)
        new, content_so_far = streamer.update(text[:cut], final)
        reasoning += new
        # What went out is never taken back: the content only grows, and so does the reasoning.
        assert content_so_far.startswith(content) and (whole.content.startswith(content_so_far))
        assert (whole.reasoning or "").startswith(reasoning)
        content = content_so_far
        if final:
            break
    assert reasoning == (whole.reasoning or "") and content == whole.content


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(PIECES, max_size=12))
def test_every_single_character_step(pieces):
    """The stream of one character at a time, the finest split there is."""
    text = "".join(pieces)
    for parser in REASONING_PARSERS.values():
        whole = parser().split(text, final=True)
        streamer = ReasoningStreamer(parser())
        reasoning, content = "", ""
        for i in range(len(text) + 1):
            new, content = streamer.update(text[:i], i == len(text))
            reasoning += new
        assert (reasoning, content) == (whole.reasoning or "", whole.content)
