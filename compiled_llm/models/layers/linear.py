"""Linear layers, including the fused ones (QKV, gate-up) that load several checkpoint tensors.

A layer owns its shape, its bias and which part of a checkpoint tensor it keeps; how the weight is
stored, loaded, packed and multiplied is its `LinearMethod`'s (compiled_llm/quantization/), asked
of the model's quantization config by the layer's name, as in vLLM. Without one every layer gets
`UnquantizedLinearMethod`: the float weight, packed once after loading for the C++ CPU GEMM where
it runs (its forward then an opaque op whose packed weight is an input like any parameter, so
compiled artifacts do not depend on the weights' values), `F.linear` elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from compiled_llm.kernels.quantized_reference import QuantizedWeight
from compiled_llm.models.checkpoint import CheckpointTensor, read
from compiled_llm.quantization.base import (
    Loaded,
    QuantizationConfig,
    UnquantizedLinearMethod,
    narrow_weight,
    part_rows,
)

# A checkpoint tensor as a layer receives it: not read yet, read, or quantized already (GGUF).
CheckpointWeight = CheckpointTensor | torch.Tensor | QuantizedWeight


def cut(loaded: CheckpointWeight, dim: int | None = None, start: int = 0, length: int | None = None) -> Loaded:
    """All of `loaded` (read), or `length` entries of dimension `dim` from `start` (a quantized
    weight on group boundaries only)."""
    if isinstance(loaded, QuantizedWeight):
        if dim is None:
            return loaded
        return narrow_weight(loaded, dim, start, loaded.shape[dim] - start if length is None else length)
    return read(loaded, dim, start, length)


class LinearBase(nn.Module):
    """`y = x W^T + b` over the stacked `output_sizes` parts, with uninitialised weights: the loader
    fills them (`load_checkpoint`), then calls `process_weights_after_loading` once."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, cpu_kernel: bool = False,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, sum(output_sizes)
        self.output_sizes = output_sizes
        method = quant_config.linear_method(prefix) if quant_config is not None else None
        self.quant_method = method if method is not None else UnquantizedLinearMethod(cpu_kernel)
        self.quant_method.create_weights(self, in_features, output_sizes, torch.get_default_dtype())
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def tie_to(self, embedding: nn.Parameter) -> None:
        """This is the LM head of a model whose embedding is tied to it."""
        self.quant_method.tie(self, embedding)

    def shard_index(self, shard: int | str | None) -> int | None:
        """Which part a checkpoint tensor is (the loader's shard id): the whole weight here."""
        if shard is not None:
            raise ValueError(f"{type(self).__name__} has one part, got shard {shard!r}")
        return None

    def load_checkpoint(self, name: str, loaded: CheckpointWeight, shard: int | str | None) -> None:
        """Checkpoint tensor `name` ("weight" or "bias") of part `shard` into its place."""
        index = self.shard_index(shard)
        if name == "weight":
            self.quant_method.load(self, self.cut_weight(loaded, index), index)
            return
        start, rows = part_rows(self, index)
        part = self.cut_bias(loaded, index)
        target = self.bias.data.narrow(0, start, rows)
        if tuple(part.shape) != tuple(target.shape):
            raise ValueError(f"shape mismatch: checkpoint {tuple(part.shape)} vs model {tuple(target.shape)}")
        target.copy_(part)

    def cut_weight(self, loaded: CheckpointWeight, index: int | None) -> Loaded:
        """The part of a checkpoint weight this layer keeps (tensor-parallel layers keep a slice)."""
        return cut(loaded)

    def cut_bias(self, loaded: CheckpointWeight, index: int | None) -> torch.Tensor:
        return read(loaded)


class Linear(LinearBase):
    """One linear map."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, cpu_kernel: bool = False,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__(in_features, [out_features], bias, cpu_kernel, quant_config, prefix)


class MergedLinear(LinearBase):
    """Several linear maps of the same input stacked along the output dim (one matmul, not many)."""

    def shard_index(self, shard: int | str | None) -> int | None:
        if not isinstance(shard, int):
            raise ValueError(f"{type(self).__name__} needs an integer shard, got {shard!r}")
        return shard


class QKVLinear(MergedLinear):
    """The query, key and value projections of one attention layer, fused."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, cpu_kernel: bool = False,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
    ) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, cpu_kernel, quant_config, prefix)

    def shard_index(self, shard: int | str | None) -> int | None:
        index = {"q": 0, "k": 1, "v": 2}.get(shard) if isinstance(shard, str) else None
        if index is None:
            raise ValueError(f"QKVLinear shards are 'q', 'k' and 'v', got {shard!r}")
        return index
