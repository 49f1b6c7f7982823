"""The runner's bitmask application equals xgrammar's own kernel, for any bitmask, any subset of
rows (the constrained ones of a mixed batch) and vocabularies wider or narrower than the bitmask
(Hypothesis); it never writes past the logits' vocabulary.

xgrammar's CPU kernel (0.2.9) writes one -inf past `vocab_size` when every id below it is allowed
and the bitmask's last word has a clear bit above it (DynamicBitset::FindFirstZero does not stop at
the bitset's size): on a tensor's last row that is 4 bytes past its allocation. Called on a bare
tensor here it corrupted the heap, and pytest died of SIGABRT or SIGSEGV later (CI, issue 21), so
the reference runs on rows padded to whole words, where that write lands in the padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.worker.grammar_bitmask import apply_grammar_bitmask


def _xgrammar_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """xgrammar's CPU kernel applied to bitmask row i and logits row rows[i], one row at a time, on
    a copy whose rows are padded to a whole number of bitmask words (see the module docstring)."""
    import xgrammar as xgr

    vocab, words = logits.shape[-1], bitmask.shape[-1]
    vocab_size = min(vocab, words * 32)
    padded = torch.zeros(logits.shape[0], max(vocab, words * 32) + 32, dtype=logits.dtype)
    padded[:, :vocab] = logits
    for i, row in enumerate(rows):
        xgr.apply_token_bitmask_inplace(padded[row : row + 1], bitmask[i : i + 1].clone(), vocab_size=vocab_size)
    return padded[:, :vocab].clone()


@settings(max_examples=80, deadline=None)
@given(
    num_rows=st.integers(1, 6),
    vocab=st.integers(1, 200),
    words_delta=st.integers(-1, 1),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    data=st.data(),
)
def test_equals_xgrammar_kernel(num_rows, vocab, words_delta, seed, dtype, data):
    words = max(1, (vocab + 31) // 32 + words_delta)
    rows = data.draw(st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=num_rows, unique=True))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen).to(dtype)
    choice = torch.randint(0, 3, (len(rows), words), generator=gen)  # whole words forbidden or allowed, or mixed
    mixed = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask = torch.where(choice == 0, 0, torch.where(choice == 1, -1, mixed)).to(torch.int32)

    expected = _xgrammar_reference(logits, bitmask, rows)
    apply_grammar_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 6, 33, 63])
@pytest.mark.parametrize("rows", [[0, 1], [1]])
def test_never_writes_past_the_vocabulary(dtype, vocab, rows):
    """Every id below the vocabulary allowed, the bitmask's bits past it clear (as xgrammar fills
    them): the case where xgrammar's CPU kernel writes one past the row. The logits are a view into
    a wider buffer, whose columns past the vocabulary must stay as they were."""
    words = (vocab + 31) // 32
    allowed = torch.zeros(words * 32, dtype=torch.int64)
    allowed[:vocab] = 1
    word = (allowed.view(words, 32) << torch.arange(32)).sum(1)
    bitmask = (word - (word >= 2**31) * 2**32).to(torch.int32).repeat(len(rows), 1)
    buffer = torch.ones(2, words * 32 + 32, dtype=dtype)
    logits = buffer[:, :vocab]
    apply_grammar_bitmask(logits, bitmask, rows)
    assert torch.equal(buffer, torch.ones_like(buffer))
