"""Weight-only quantization in plain torch: the format the CPU kernels compute with, how a float
weight gets into it, and the linear layer it stands for.

One format covers GGUF's Q8_0 / Q4_0 / Q4_1 and the weight-only int8 / int4 of gpt-fast and torchao:
per output feature n and group g of `group_size` consecutive inputs (the last group shorter where
K is not a multiple of it), `w[n, k] = scales[n, g] * q[n, k] (+ mins[n, g] for 4-bit)`, q int8
(8-bit, symmetric) or uint8 0..15 (4-bit, asymmetric), scales and mins float16 or float32 (both the
same; the packed layout keeps their dtype). The C++ kernels (csrc/cpu_quant_gemm.cpp) are tested
against these functions, and they are the fallback where the kernels cannot be built.

Whose scales are fp16: GGUF's (gguf_blocks.py), which are fp16 in the file, so a packed Q4_1 weight
reads 0.625 bytes per weight as llama.cpp's does. The quantizers here keep float32 ones: a scale
computed from a float checkpoint need not fit fp16 (|w| beyond 65504 overflows it, groups of tiny
weights fall into its subnormals and lose precision), so fp16 ones would need a fallback anyway
and q re-derived from the rounded scales; and the bytes they would save are few for the formats
offered: 4 per row for per-channel int8, 8 per 128 weights for int4 group 128 (0.5625 bytes per
weight against 0.53).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight in the group-wise format (see the module docstring)."""

    q: torch.Tensor  # [N, K]: int8 (8-bit) or uint8 holding 0..15 (4-bit)
    scales: torch.Tensor  # [N, ceil(K / group_size)] float32 or float16
    mins: torch.Tensor | None  # the same shape and dtype, for 4-bit; None for 8-bit
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


def _groups(weight: torch.Tensor, group_size: int) -> list[torch.Tensor]:
    """The weight's column groups, float32 [N, group_size] each (the last may be narrower)."""
    return list(weight.float().split(group_size, dim=1))


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 with one scale per row (`group_size` None: per channel, as gpt-fast's int8) or
    per group: scale = max |w| / 127, q = round(w / scale)."""
    size = group_size or weight.shape[1]
    qs, scales = [], []
    for w in _groups(weight, size):
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        qs.append(torch.round(w / safe).clamp(-128, 127).to(torch.int8))
        scales.append(scale)
    return QuantizedWeight(torch.cat(qs, dim=1), torch.cat(scales, dim=1), None, 8, size)


def quantize_int4(weight: torch.Tensor, group_size: int = 128) -> QuantizedWeight:
    """Asymmetric 4-bit per group, as gpt-fast's int4: scale = (max - min) / 15, q = round((w - min) /
    scale) in 0..15, so w ~ scale * q + min. (gpt-fast stores zero = min + 8 * scale and computes
    (q - 8) * scale + zero: the same weight.)"""
    qs, scales, mins = [], [], []
    for w in _groups(weight, group_size):
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        scale = (hi - lo) / 15
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        qs.append(torch.round((w - lo) / safe).clamp(0, 15).to(torch.uint8))
        scales.append(scale)
        mins.append(lo)
    return QuantizedWeight(torch.cat(qs, dim=1), torch.cat(scales, dim=1), torch.cat(mins, dim=1), 4, group_size)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the format stands for (scale * q, then + min in float32, fp16 scales
    and mins widened exactly: two roundings, as the gguf package's de-quantizer computes it)."""
    k = weight.shape[1]
    w = weight.q.float() * weight.scales.float().repeat_interleave(weight.group_size, dim=1)[:, :k]
    if weight.mins is not None:
        w = w + weight.mins.float().repeat_interleave(weight.group_size, dim=1)[:, :k]
    return w


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b with W de-quantized (float32 activations)."""
    return F.linear(x, dequantize(weight), bias)


INT8_ACTIVATION_BLOCK = 32


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) as the CPU kernel's int8-activation path sees it (4-bit weights
    in 16-wide panels on AVX2, 8- and 4-bit ones in 32-wide panels with AVX512-VNNI; llama.cpp's Q8
    activations): per row and block of 32 inputs,
    d = max|x| / 127 and q = round(x * (127 / max|x|)) (to even, in float32), returned as d * q in
    float64."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // INT8_ACTIVATION_BLOCK, INT8_ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # a tensor divided by a tensor: `127 / amax` would be 127 * (1 / amax), an ulp away at times
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse)
    return (q.double() * (amax / 127).double()).reshape(m, k)


def int8_activation_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the int8-activation path computes, in float64: the weight against the quantized x (its
    mins too, as llama.cpp's Q4_1 x Q8_1 dot product does), plus the bias."""
    y = int8_activations(x) @ dequantize(weight).double().T
    return y + bias.double() if bias is not None else y


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for a 16-bit weight (float16 or bfloat16) with float32 activations."""
    return F.linear(x, weight.float(), bias)
