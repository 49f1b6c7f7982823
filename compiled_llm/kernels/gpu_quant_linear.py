"""The GPU side of the weight-only quantized linears: the layout a GPU keeps a `QuantizedWeight` in,
and the custom op `compiled_llm::quant_gemm` that computes with it (kernels/triton_quant_gemm.py).

The op is opaque to the compiler, as the C++ CPU ops are: Dynamo traces it through its fake, the
compiled pieces call it like any other op, and its packed weight is an input like any parameter,
so compiled artifacts do not depend on the weights' values. Triton is imported only when the op
runs, so this module loads where Triton is not installed. The op runs wherever Triton does: on a
GPU, and on the CPU under the Triton interpreter (TRITON_INTERPRET=1), where the tests check it.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from compiled_llm.kernels.quantized_reference import QuantizedWeight

_lib = torch.library.Library("compiled_llm", "FRAGMENT")
_lib.define("quant_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int bits, "
            "int group_size) -> Tensor")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] holding 0..15 -> uint8 [N, ceil(K / 2)]: input 2j in the low nibble of byte j,
    2j + 1 in the high one (an odd K gets a zero nibble, which the kernel never reads)."""
    if q.shape[1] % 2:
        q = F.pad(q, (0, 1))
    return q[:, 0::2] | (q[:, 1::2] << 4)


def gpu_layout(weight: QuantizedWeight, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qweight, scales, mins) on `device` as `quant_gemm` reads them: 8-bit q as it is, 4-bit q
    two a byte (0.5 bytes a weight: a GGUF Q4_1 weight keeps its 0.625 bytes with its fp16 scale
    and min per 32); scales and mins contiguous in their own dtype (GGUF's fp16, the quantizers'
    float32), so the weight is the one the format stands for, bit for bit."""
    q = pack_nibbles(weight.q) if weight.bits == 4 else weight.q
    mins = None if weight.mins is None else weight.mins.contiguous().to(device)
    return q.contiguous().to(device), weight.scales.contiguous().to(device), mins


def _quant_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                bias: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    from compiled_llm.kernels.triton_quant_gemm import quant_gemm

    return quant_gemm(x, qweight, scales, mins, bias, bits, group_size)


def _quant_gemm_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     bias: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


_lib.impl("quant_gemm", _quant_gemm, "CUDA")
_lib.impl("quant_gemm", _quant_gemm, "CPU")  # the Triton interpreter's device
torch.library.register_fake("compiled_llm::quant_gemm", _quant_gemm_fake, lib=_lib)
