"""Triton kernels for batched LoRA on GPUs (the math and layouts: kernels/lora.py).

One program per (token, block of outputs): it reads the token's slot and, for a slot >= 0, the
adapter's rows it needs (B transposed, [R, N] a slot: a block of outputs reads R contiguous runs);
a slot of -1 writes zeros (shrink) or copies `y` (expand). The grid depends on the token count
only, never on the slots' values, so a CUDA graph captures it and replays it for any mix of
adapters. Products accumulate in float32; outputs take the activations'
dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, out_ptr, T, K, R, stride_xm, stride_om,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rs < R
    slot = tl.load(idx_ptr + i).to(tl.int64)
    acc = tl.zeros((BLOCK_R,), tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot * R * K + rs.to(tl.int64)[:, None] * K
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + i * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + i * stride_om + rs, acc.to(out_ptr.dtype.element_ty), mask=r_ok)


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(y_ptr, t_ptr, b_ptr, scale_ptr, idx_ptr, out_ptr, T, N, R, col0, width, t_col0,
                   stride_ym, stride_tm, stride_om, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    i = tl.program_id(0)
    cols = col0 + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < col0 + width
    acc = tl.load(y_ptr + i * stride_ym + cols, mask=c_ok, other=0.0).to(tl.float32)
    slot = tl.load(idx_ptr + i).to(tl.int64)
    if slot >= 0:
        rs = tl.arange(0, BLOCK_R)
        r_ok = rs < R
        t = tl.load(t_ptr + i * stride_tm + t_col0 + rs, mask=r_ok, other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + slot * R * N + rs.to(tl.int64)[:, None] * N + cols[None, :],
                     mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.load(scale_ptr + slot).to(tl.float32) * tl.sum(bt * t[:, None], axis=0)
    tl.store(out_ptr + i * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=c_ok)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    num_tokens, k = x.shape
    rank = lora_a.shape[1]
    out = x.new_empty(num_tokens, rank)
    if num_tokens == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    block_r = min(triton.next_power_of_2(rank), 64)
    grid = (num_tokens, triton.cdiv(rank, block_r))
    _shrink_kernel[grid](x, lora_a.contiguous(), indices, out, num_tokens, k, rank, x.stride(0), out.stride(0),
                         BLOCK_R=block_r, BLOCK_K=128)
    return out


def lora_expand(
    y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, scalings: torch.Tensor, indices: torch.Tensor,
    slices: Sequence[int],
) -> torch.Tensor:
    num_tokens, n = y.shape
    rank = lora_b.shape[1]
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    if y.stride(1) != 1:
        y = y.contiguous()
    if t.stride(1) != 1:
        t = t.contiguous()
    lora_b = lora_b.contiguous()
    block_n = 64
    start = 0
    for j, width in enumerate(slices):  # one launch per sub-projection (at most three)
        grid = (num_tokens, triton.cdiv(width, block_n))
        _expand_kernel[grid](y, t, lora_b, scalings, indices, out, num_tokens, n, rank, start, width, j * rank,
                             y.stride(0), t.stride(0), out.stride(0), BLOCK_N=block_n,
                             BLOCK_R=triton.next_power_of_2(rank))
        start += width
    return out
