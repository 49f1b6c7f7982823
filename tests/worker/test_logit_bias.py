"""logit_bias: kept per request row and applied by the sampler to the whole batch at once, it
equals adding each request's bias to its logits row (Hypothesis); +100 forces a token and -100
bans it on a real engine; ids outside the vocabulary and biases outside [-100, 100] are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm import LLM, SamplingParams
from compiled_llm.messages.scheduler_output import NewRequestData
from compiled_llm.worker.input_batch import InputBatch
from compiled_llm.worker.sampler import Sampler

VOCAB = 48

bias_strategy = st.one_of(
    st.none(),
    st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100, allow_nan=False), min_size=1, max_size=6),
)


@settings(max_examples=60, deadline=None)
@given(biases=st.lists(bias_strategy, min_size=1, max_size=6), seed=st.integers(0, 2**16), data=st.data())
def test_batched_bias_equals_each_row_plus_its_bias(biases, seed, data):
    batch = InputBatch(8, 16, 2, "cpu", VOCAB, [2])
    rows = []
    for i, bias in enumerate(biases):
        params = SamplingParams(temperature=0.0, max_tokens=5, logit_bias=bias)
        rows.append(batch.add(NewRequestData(f"r{i}", [1, 2, 3], 3, params, [1], 0)))
    order = np.asarray(data.draw(st.permutations(rows)), dtype=np.int64)
    logits = torch.randn(len(order), VOCAB, generator=torch.Generator().manual_seed(seed))
    expected = logits.clone()
    for i, row in enumerate(order.tolist()):
        for token, value in (biases[rows.index(row)] or {}).items():
            expected[i, token] += value
    meta = batch.sampling.metadata(order, np.zeros(len(order), dtype=np.int64))
    if all(b is None for b in biases):
        assert meta.logit_bias_rows is None  # nobody asked: nothing is built
    sampled = Sampler()(logits.clone(), meta).sampled
    assert torch.equal(sampled, expected.argmax(dim=-1))


def test_a_removed_row_forgets_its_bias():
    batch = InputBatch(4, 16, 2, "cpu", VOCAB, [2])
    batch.add(NewRequestData("a", [1, 2], 2, SamplingParams(logit_bias={5: 100.0}), [1], 0))
    batch.remove("a")
    row = batch.add(NewRequestData("b", [1, 2], 2, SamplingParams(), [1], 0))
    assert batch.sampling.metadata(np.asarray([row]), np.zeros(1, dtype=np.int64)).logit_bias_rows is None


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20)


def test_plus_100_forces_a_token_and_minus_100_bans_it(llm):
    prompt = "The quick brown fox"
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
    banned = sorted(set(alone))
    outs = llm.generate([prompt] * 4, [
        plain,
        plain.clone(logit_bias={4321: 100.0}),
        plain.clone(logit_bias={t: -100.0 for t in banned}),
        plain.clone(temperature=1.0, seed=3, logit_bias={777: 100.0}),
    ], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone  # an unbiased request in the batch is untouched
    assert outs[1].outputs[0].token_ids == [4321] * 8
    assert not set(outs[2].outputs[0].token_ids) & set(banned)
    assert outs[3].outputs[0].token_ids == [777] * 8


@pytest.mark.parametrize(
    "bias, words",
    [({10**6: 1.0}, "outside the vocabulary"), ({-1: 1.0}, "non-negative token ids"), ({5: 100.5}, r"\[-100, 100\]"),
     ({5: math.nan}, "finite"), ({5: math.inf}, "finite")],
)
def test_bad_logit_bias_is_a_value_error(llm, bias, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(["Hi"], SamplingParams(logit_bias=bias), use_tqdm=False)
