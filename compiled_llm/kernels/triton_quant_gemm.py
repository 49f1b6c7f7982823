"""Triton GEMM over weight-only quantized weights for GPUs: `y = x dequant(W)^T + b`, the weight
de-quantized tile by tile in registers inside the GEMM, so a step reads the packed bytes only.

One kernel serves every format of kernels/quantized_reference.py as a GPU keeps it
(`kernels/gpu_quant_linear.py: gpu_layout`): per-channel int8 (one scale per output row, applied
once to the accumulator), group-wise int8 (GGUF's Q8_0) and group-wise 4-bit with a min per group
(int4, asymmetric; GGUF's Q4_1, and Q4_0 whose min is -8 d), two 4-bit values a byte, input 2j in
the low nibble of byte j and 2j + 1 in the high one. Activations fp16, bf16 or fp32 (fp32: an
IEEE-exact dot, not TF32), accumulation in fp32, output in the activations' dtype.

The launch grid depends on the row count only, never on values read back, so a CUDA graph captures
it; the block sizes follow the row count (decode: few rows, narrow output tiles so that enough
programs stream the weight; prefill: larger tiles that reuse each weight tile for more rows).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# (rows up to, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): tl.dot takes tiles of 16 and up.
_CONFIGS = (
    (16, 16, 32, 128, 4, 4),  # decode: a weight tile per program, many programs
    (64, 64, 64, 64, 4, 3),
    (None, 64, 128, 64, 8, 3),  # prefill: each weight tile serves 64 rows
)
# The interpreter cannot tl.dot bfloat16 (triton-lang/triton#11584): under TRITON_INTERPRET=1
# bfloat16 tiles are widened to float32 for the dot (everything else runs as on a GPU).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M"])
def _quant_gemm_kernel(
    x_ptr, q_ptr, scales_ptr, mins_ptr, bias_ptr, y_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_ym,
    BITS: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per (BLOCK_M rows, BLOCK_N outputs). Row blocks vary fastest, so programs that
    run at the same time share their weight tile through L2."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = cols.to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = col_ok[:, None] & k_ok[None, :]
        if BITS == 8:
            q = tl.load(q_ptr + w_rows * stride_qn + ks[None, :], mask=w_ok, other=0)
        else:
            pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(q_ptr + w_rows * stride_qn + pairs[None, :],
                             mask=col_ok[:, None] & (pairs * 2 < K)[None, :], other=0)
            q = tl.interleave(packed & 0xF, packed >> 4)  # inputs 2j, 2j + 1 of byte j, in order
        w = q.to(tl.float32)
        if not PER_CHANNEL:
            groups = w_rows * stride_sn + (ks // group_size)[None, :]
            w = w * tl.load(scales_ptr + groups, mask=w_ok, other=0.0).to(tl.float32)
            if HAS_MINS:
                w = w + tl.load(mins_ptr + groups, mask=w_ok, other=0.0).to(tl.float32)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if PER_CHANNEL:  # w = s q: the scale of each output once, on the sum
        acc = acc * tl.load(scales_ptr + cols.to(tl.int64) * stride_sn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _config(rows: int) -> tuple[int, int, int, int, int]:
    for limit, *config in _CONFIGS:
        if limit is None or rows <= limit:
            return tuple(config)  # type: ignore[return-value]
    raise AssertionError("the last config takes any row count")


def quant_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
    bias: torch.Tensor | None, bits: int, group_size: int,
) -> torch.Tensor:
    """`x [..., K] @ dequant(W)^T + bias` in x's dtype. `qweight`: int8 [N, K] (8-bit) or uint8
    [N, ceil(K / 2)] nibble pairs (4-bit); `scales` (and `mins`, 4-bit): [N, ceil(K / group_size)]
    contiguous, fp16 or fp32; one column of scales and no mins: per channel."""
    k = x.shape[-1]
    n = qweight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    block_m, block_n, block_k, num_warps, num_stages = _config(m)
    per_channel = scales.shape[1] == 1 and mins is None
    dot_fp32 = x.dtype == torch.float32 or (_INTERPRETED and x.dtype == torch.bfloat16)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_gemm_kernel[grid](
        x2, qweight, scales, scales if mins is None else mins, scales if bias is None else bias, y,
        m, n, k, group_size,
        x2.stride(0), x2.stride(1), qweight.stride(0), scales.stride(0), y.stride(0),
        BITS=bits, PER_CHANNEL=per_channel, HAS_MINS=mins is not None, HAS_BIAS=bias is not None,
        DOT_FP32=dot_fp32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y.view(*x.shape[:-1], n)
