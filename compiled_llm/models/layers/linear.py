"""Linear layers, including the fused ones (QKV, gate-up) that load several checkpoint tensors.

On a CPU with the C++ kernels built (float32), each layer packs its weight once, after loading
(`process_weights_after_loading`), into the panel layout of the packed GEMM
(kernels/csrc/cpu_gemm.cpp), and its forward calls that op. The traced graph then holds an opaque
op whose packed weight is an input like any parameter: compiled artifacts do not depend on the
weights' values (identical layers share them, the compile cache stays whole), and every row
count, decode or prefill, streams the weight sequentially instead of through `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in the packed GEMM's panel layout (a copy; the C++ kernels must be built)."""
    return torch.ops.compiled_llm_cpu.pack_linear_weight(weight.detach(), 0)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cpu_kernel: bool,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x W^T + b`: by the packed GEMM when `packed` (`pack_weight(weight)`) is given, else `F.linear`."""
    if packed is not None:
        return torch.ops.compiled_llm_cpu.packed_linear(x, packed, bias, weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """`y = x W^T + b` with uninitialised parameters: the loader fills them, then calls
    `process_weights_after_loading` once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, cpu_kernel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.cpu_kernel = cpu_kernel
        # The weight in the packed GEMM's layout, made after loading (CPU kernels only).
        self.register_buffer("packed_weight", None, persistent=False)

    def process_weights_after_loading(self) -> None:
        """With the C++ CPU kernels: pack the loaded weight for the packed GEMM."""
        if self.cpu_kernel and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu":
            self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.cpu_kernel, self.packed_weight)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | str | None) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {tuple(param.shape)}")
        param.data.copy_(loaded)
        self.packed_weight = None  # stale until packed again


class MergedLinear(Linear):
    """Several linear maps of the same input stacked along the output dim (one matmul, not many)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, cpu_kernel: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias, cpu_kernel)
        self.output_sizes = output_sizes
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | str | None) -> None:
        index = self.shard_index(shard)
        start, size = self.offsets[index], self.output_sizes[index]
        target = param.data.narrow(0, start, size)
        if loaded.shape != target.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs shard {tuple(target.shape)}")
        target.copy_(loaded)
        self.packed_weight = None

    def shard_index(self, shard: int | str | None) -> int:
        if not isinstance(shard, int):
            raise ValueError(f"{type(self).__name__} needs an integer shard, got {shard!r}")
        return shard


class QKVLinear(MergedLinear):
    """The query, key and value projections of one attention layer, fused."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, cpu_kernel: bool = False
    ) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, cpu_kernel)

    def shard_index(self, shard: int | str | None) -> int:
        index = {"q": 0, "k": 1, "v": 2}.get(shard) if isinstance(shard, str) else None
        if index is None:
            raise ValueError(f"QKVLinear shards are 'q', 'k' and 'v', got {shard!r}")
        return index
