"""The C++ decode-sized linear against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_llm.kernels.cpu_extension import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 16, 17, 40])
@pytest.mark.parametrize("out_features", [64, 50])  # 50: rows left over after blocks of 4
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, out_features, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(out_features, 96, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    torch.testing.assert_close(torch.ops.compiled_llm_cpu.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_strided_rows_and_odd_inner_size():
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(6, 3 * 64, generator=g)
    x = fused[:, 64:128]  # rows strided like a slice of a fused projection
    w = torch.randn(32, 64, generator=g)
    torch.testing.assert_close(torch.ops.compiled_llm_cpu.linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    odd = torch.randn(5, 60, generator=g)  # not a multiple of 8: falls back to F.linear
    w60 = torch.randn(8, 60, generator=g)
    torch.testing.assert_close(torch.ops.compiled_llm_cpu.linear(odd, w60, None), F.linear(odd, w60))
