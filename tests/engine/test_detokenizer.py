"""Incremental detokenization and stop strings with the real tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from compiled_llm.engine.detokenizer import IncrementalDetokenizer
from compiled_llm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(real_model_path):
    return AutoTokenizer.from_pretrained(real_model_path)


def feed(tok, text, params, prompt="Say:"):
    prompt_ids = tok(prompt)["input_ids"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, prompt_ids, params)
    for i, t in enumerate(ids):
        stop, used = d.update([t])
        if stop is not None:
            return d, stop, i + 1, ids
    return d, None, len(ids), ids


def test_streamed_text_equals_full_decode(tokenizer):
    text = " Hello, wörld! 日本語 and emoji 🙂 done."
    d, stop, _, ids = feed(tokenizer, text, SamplingParams())
    assert stop is None
    assert d.output_text == tokenizer.decode(ids)


def test_stop_string_across_token_boundaries(tokenizer):
    text = " The quick brown fox jumps over the lazy dog"
    d, stop, used, ids = feed(tokenizer, text, SamplingParams(stop=["n fox j"]))
    assert stop == "n fox j"
    assert d.output_text == " The quick brow"
    assert used < len(ids)


def test_include_stop_string(tokenizer):
    d, stop, _, _ = feed(tokenizer, " one two three four", SamplingParams(stop=["three"], include_stop_str_in_output=True))
    assert d.output_text == " one two three"


def test_earliest_stop_string_wins(tokenizer):
    d, stop, _, _ = feed(tokenizer, " alpha beta gamma", SamplingParams(stop=["gamma", "beta"]))
    assert stop == "beta" and d.output_text == " alpha "


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer):
    prompt_ids = tokenizer("x")["input_ids"]
    d = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["STOP"]))
    streamed = ""
    for t in tokenizer(" go go ST", add_special_tokens=False)["input_ids"]:
        d.update([t])
        streamed += d.get_next_output_text(finished=False, delta=True)
    assert not streamed.endswith("ST"), "a possible stop-string prefix must be held back"
    streamed += d.get_next_output_text(finished=True, delta=True)
    assert streamed == d.output_text == " go go ST"
