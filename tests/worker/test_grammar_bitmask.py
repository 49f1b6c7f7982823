"""The runner's bitmask application equals xgrammar's own kernel, for any bitmask, any subset of
rows (the constrained ones of a mixed batch) and vocabularies wider or narrower than the bitmask
(Hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.worker.grammar_bitmask import apply_grammar_bitmask


@settings(max_examples=80, deadline=None)
@given(
    num_rows=st.integers(1, 6),
    vocab=st.integers(1, 200),
    words_delta=st.integers(-1, 1),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_equals_xgrammar_kernel(num_rows, vocab, words_delta, seed, data):
    import xgrammar as xgr

    words = max(1, (vocab + 31) // 32 + words_delta)
    rows = data.draw(st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=num_rows, unique=True))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen)
    choice = torch.randint(0, 3, (len(rows), words), generator=gen)  # whole words forbidden or allowed, or mixed
    mixed = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask = torch.where(choice == 0, 0, torch.where(choice == 1, -1, mixed)).to(torch.int32)

    expected = logits.clone()
    for i, row in enumerate(rows):
        one = expected[row : row + 1].clone()
        xgr.apply_token_bitmask_inplace(one, bitmask[i : i + 1].clone(), vocab_size=min(vocab, words * 32))
        expected[row] = one[0]
    apply_grammar_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
