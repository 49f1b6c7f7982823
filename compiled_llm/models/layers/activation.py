"""SwiGLU's gate: silu(gate) * up over the fused gate-up projection.

The gate is the op `compiled_llm::silu_and_mul`, implemented for every backend by its
decomposition (CompositeImplicitAutograd): Inductor fuses it as plain tensor code, and a fusion
pass can fold the one recognisable node into the projection that consumes it
(compilation/silu_mul_linear_fusion.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_lib = torch.library.Library("compiled_llm", "FRAGMENT")
_lib.define("silu_and_mul(Tensor x) -> Tensor")
_lib.impl("silu_and_mul", silu_and_mul, "CompositeImplicitAutograd")


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.compiled_llm.silu_and_mul(x)
