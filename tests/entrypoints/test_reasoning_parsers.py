"""The reasoning parsers: `<think>` blocks split from the content, whole or streamed, a streamed
text split at every position adding up to the whole (Hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStreamer
from compiled_llm.entrypoints.openai.reasoning_parsers.think import OpenedThinkBlockParser

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
OPENED = OpenedThinkBlockParser  # under a request's own structured-output constraint
PARSERS = {**REASONING_PARSERS, OPENED.name: OPENED}
CALL = '<tool_call>{"name": "f"}</tool_call>'


@pytest.mark.parametrize("parser, text, reasoning, content", [
    (QWEN3, "<think>Let me see.</think>\n\nParis.", "Let me see.", "\n\nParis."),
    (QWEN3, "\n<think>a</think>b", "a", "b"),
    # As vLLM 0.32: reasoning from the output's start, the template having opened the block
    # (Qwen3-2507 thinking models); a block never closed is all reasoning.
    (QWEN3, "Thought.</think>Paris.", "Thought.", "Paris."),
    (QWEN3, "Paris.", "Paris.", ""),
    (QWEN3, f"Thought.{CALL}", "Thought.", CALL),  # a call from within the thought ends it
    (QWEN3, f"<think>a</think>{CALL}", "a", CALL),
    (QWEN3, "<think>cut short", "cut short", ""),  # max_tokens inside the block
    (QWEN3, "<think></think>", "", ""),
    (R1, "<think>a</think>b", "a", "b"),
    (R1, "opened by the template</think>answer", "opened by the template", "answer"),
    (R1, "never closed", "never closed", ""),
    (R1, f"a{CALL}", f"a{CALL}", ""),
    (R1, "", "", ""),
    (OPENED, "<think>a</think>b", "a", "b"),
    (OPENED, "Paris.", None, "Paris."),  # no block: all content
    (OPENED, "Paris.</think>", None, "Paris.</think>"),  # a block the output did not open is no block
    (OPENED, f"<think>a{CALL}</think>b", f"a{CALL}", "b"),
])
def test_whole_outputs(parser, text, reasoning, content):
    split = parser().split(text, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("parser", [QWEN3, R1, OPENED])
def test_thinking_turned_off_is_all_content(parser):
    """chat_template_kwargs.enable_thinking false: the template wrote an empty block into the prompt."""
    split = parser(thinking=False).split("<think>a</think>b", final=True)
    assert (split.reasoning, split.content) == (None, "<think>a</think>b")


def test_partial_tags_are_held_back_while_streaming():
    assert OPENED().split("<thi", final=False).content == ""  # may still open a block
    assert OPENED().split("<thi", final=True).content == "<thi"
    assert QWEN3().split("<thi", final=True).reasoning == "<thi"
    assert QWEN3().split("<think>abc</thi", final=False).reasoning == "abc"
    assert QWEN3().split("abc<tool_", final=False).reasoning == "abc"
    assert R1().split("abc</", final=False).reasoning == "abc"
    assert R1().split("abc<tool_", final=False).reasoning == "abc<tool_"


# Texts made of the pieces that matter (tags, their fragments, whitespace) and plain words.
PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", "</thi", "nk>", ">", "\n", " ", "a",
                          "Paris", "é", "<tool_call>", "<tool_", "call>"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=12), name=st.sampled_from(sorted(PARSERS)), data=st.data())
def test_streaming_adds_up_to_the_whole_at_every_split(pieces, name, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    parser = PARSERS[name]
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
    for parser in PARSERS.values():
        whole = parser().split(text, final=True)
        streamer = ReasoningStreamer(parser())
        reasoning, content = "", ""
        for i in range(len(text) + 1):
            new, content = streamer.update(text[:i], i == len(text))
            reasoning += new
        assert (reasoning, content) == (whole.reasoning or "", whole.content)
