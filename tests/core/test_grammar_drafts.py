"""Speculative drafts under a grammar (`RequestGrammar.valid_prefix` / `fill_bitmasks`): the
prefix a grammar allows is the one token-by-token acceptance allows, the bitmask row of each
verified position is the one the matcher gives after that prefix, and the matcher is left where it
was (Hypothesis over walks through a JSON-schema grammar on the bundled tokenizer, some broken by a
random token)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_llm.core.structured_outputs.grammar import RequestGrammar, bitmask_width

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def compiled_person(real_model_path):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON)), len(tokenizer)


def allowed(bitmask_row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), walk=st.integers(0, 12), length=st.integers(0, 10), broken=st.integers(-1, 9))
def test_drafts_are_cut_where_the_grammar_forbids_and_each_position_gets_its_bitmask(
        compiled_person, seed, walk, length, broken):
    compiled, vocab = compiled_person
    rng = np.random.default_rng(seed)
    grammar = RequestGrammar(compiled)
    scratch = torch.empty((1, bitmask_width(vocab)), dtype=torch.int32)
    walked: list[int] = []
    for _ in range(walk):  # somewhere inside the grammar
        grammar.fill_bitmask(scratch, 0)
        if grammar.matcher.is_terminated():
            break
        walked.append(int(rng.choice(allowed(scratch[0], vocab))))
        grammar.accept("r", walked[-1])
    # A walk on from there (the drafts), with one random token at `broken` (often forbidden).
    reference = RequestGrammar(compiled)
    for token in walked:
        reference.accept("r", token)
    drafts, expected_rows = [], []
    for j in range(length):
        if reference.matcher.is_terminated():
            break
        reference.fill_bitmask(scratch, 0)
        expected_rows.append(scratch[0].clone())
        token = int(rng.integers(vocab)) if j == broken else int(rng.choice(allowed(scratch[0], vocab)))
        drafts.append(token)
        if not reference.matcher.accept_token(token):
            break
    before = torch.empty((1, bitmask_width(vocab)), dtype=torch.int32)
    grammar.fill_bitmask(before, 0)

    valid = grammar.valid_prefix(drafts)
    expected_valid = next((j for j, t in enumerate(drafts) if t not in set(allowed(expected_rows[j], vocab))),
                          len(drafts))
    assert valid == expected_valid
    rows = torch.zeros((valid + 1, bitmask_width(vocab)), dtype=torch.int32)
    grammar.fill_bitmasks(rows, 0, drafts[:valid])
    for j in range(valid + 1):
        probe = RequestGrammar(compiled)
        for token in walked + drafts[:j]:
            probe.accept("r", token)
        if probe.matcher.is_terminated():  # past the end of the grammar: anything (the request stops there)
            assert (rows[j] == -1).all(), j
        else:
            probe.fill_bitmask(scratch, 0)
            assert torch.equal(rows[j], scratch[0]), j
    after = torch.empty_like(before)
    grammar.fill_bitmask(after, 0)
    assert torch.equal(before, after)  # the matcher is where it was
