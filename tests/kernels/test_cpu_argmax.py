"""The kernels' row-wise argmax gives torch.argmax's indices: the first maximum, the first NaN of a
row holding one, -0.0 equal to +0.0, rows of -inf; and the samplers use it on a CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.kernels.cpu_extension import cpu_kernels_available
from compiled_llm.worker.sampler import argmax_rows

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built")

SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 70), levels=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=6))
def test_matches_torch_argmax(rows, cols, levels, seed, specials):
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values make ties common; specials land anywhere, in any row.
    x = torch.randint(0, levels, (rows, cols), generator=generator).float()
    for position, value in specials:
        x.view(-1)[position % x.numel()] = value
    assert torch.equal(torch.ops.compiled_llm_cpu.argmax_rows(x), x.argmax(dim=-1))


def test_vocabulary_sized_rows_and_strided_input():
    x = torch.randn(33, 49152)
    x[3, 40000] = x[3, 7] = 100.0  # a tie: the first wins
    x[5].fill_(float("-inf"))
    x[6, 49151] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    view = x[:, ::2]  # not contiguous
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))


def test_other_inputs_take_torch_argmax():
    x = torch.randn(4, 100, dtype=torch.float64)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(torch.randn(0, 5)), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.compiled_llm_cpu.argmax_rows(x)
