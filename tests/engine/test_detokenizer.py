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
    params = SamplingParams(stop=["three"], include_stop_str_in_output=True)
    d, stop, _, _ = feed(tokenizer, " one two three four", params)
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


def test_stop_strings_wait_for_min_tokens(tokenizer):
    text = " stop here, then more words and stop again"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    early = feed(tokenizer, text, SamplingParams(stop=["stop"]))
    assert early[1] == "stop" and early[0].output_text == " "
    # Text of the first min_tokens tokens cannot hold a stop string: the second "stop" ends it.
    d, stop, used, _ = feed(tokenizer, text, SamplingParams(stop=["stop"], min_tokens=3))
    assert stop == "stop" and used > 3
    assert d.output_text == text[: text.rindex("stop")]
    assert used < len(ids)


@pytest.mark.parametrize("include", [False, True])
def test_text_of_the_engines_stop_token_is_left_out(tokenizer, include):
    ids = tokenizer(" one two three", add_special_tokens=False)["input_ids"]
    params = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
    d = IncrementalDetokenizer(tokenizer, [1], params)
    d.update(ids[:-1])
    stop, used = d.update(ids[-1:], stop_terminated=True)
    assert stop is None and used == 1
    assert d.output_text == tokenizer.decode(ids if include else ids[:-1])
