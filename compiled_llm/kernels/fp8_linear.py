"""FP8 (e4m3) linears in plain torch, traced into the compiled pieces: rows quantized with one
scale each, and the two forwards of `--quantization fp8` (compiled_llm/quantization/fp8.py).

- `fp8_scaled_linear`: the activations quantized per token at run time (dynamic scales), then
  `torch._scaled_mm` over the fp8 operands with both rows' scales (Hopper and Ada: FP8 tensor
  cores). Torch on a CPU runs it too (2.13), which is how the tests check it without a GPU.
- `fp8_weight_only_linear`: the fp8 weight widened to the activations' dtype inside the piece
  (exact: every e4m3 value is a bf16, fp16 and fp32 value), the matmul, then the output channels'
  scales; for GPUs without FP8 tensor cores and for CPUs. The weight is kept in 1 byte either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest row scale: an all-zero row quantizes to zeros instead of dividing by zero.
_MIN_SCALE = 1e-12
# The scaled GEMM's shapes: cuBLASLt and CUTLASS take fp8 operands whose K and N are multiples of 16.
SCALED_MM_MULTIPLE = 16


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, K] -> (q [R, K] e4m3, scale [R, 1] float32) with t ~ scale q: each row's largest
    magnitude maps to e4m3's largest finite value, 448 (round to nearest)."""
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    scale = amax.clamp(min=_MIN_SCALE) / FP8_MAX
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 rows that (q, scale) stand for."""
    return q.float() * scale.reshape(-1, 1)


def fp8_weight_only_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b, W = weight_scale[n] * weight[n, k] in e4m3, computed in x's dtype."""
    y = F.linear(x, weight.to(x.dtype)) * weight_scale.to(x.dtype)
    return y + bias if bias is not None else y


def fp8_scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b with x quantized per token to e4m3 and one FP8 GEMM. The GEMM writes bfloat16, the
    output every row-wise FP8 GEMM takes (CUTLASS's on Ada and Hopper takes no other), then x's
    dtype; its error is the activations' e4m3 rounding (2^-4 of a row's values), not this."""
    k, n = x.shape[-1], weight.shape[0]
    xq, x_scale = quantize_fp8_rows(x.reshape(-1, k))
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, n),
                         out_dtype=torch.bfloat16)
    y = y.to(x.dtype).view(*x.shape[:-1], n)
    return y + bias if bias is not None else y


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: NVIDIA compute capability 8.9 (Ada) and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
