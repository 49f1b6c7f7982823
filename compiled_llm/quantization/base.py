"""The seam between a linear layer and how its weight is stored: one `QuantizationConfig` per
method, one `LinearMethod` per layer (as vLLM's `QuantizationConfig` / `LinearMethodBase`).

A layer (models/layers/linear.py, parallel.py) owns its shape, its bias and its tensor-parallel
slicing; the method owns the weight: which tensors it is kept in (`create_weights`), how one
checkpoint tensor gets into them (`load`), the one-time packing for a kernel
(`process_weights_after_loading`) and the forward (`apply`). The model code never knows which
method runs. `apply` is traced by Dynamo: pure tensor code calling torch ops, no data-dependent
Python, so the compiled pieces hold the method's op like any other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from compiled_llm.kernels.quantized_reference import QuantizedWeight

if TYPE_CHECKING:
    from compiled_llm.config import ModelConfig

# A checkpoint tensor as a method receives it: float, or already quantized (a GGUF block tensor).
Loaded = torch.Tensor | QuantizedWeight


class LinearMethod(ABC):
    """How one linear layer stores, loads and applies its weight `W` [out_features, in_features]."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register the layer's weight parameters or buffers (`output_sizes`: the fused parts, e.g.
        q, k, v, stacked along the output dimension in that order)."""

    @abstractmethod
    def load(self, layer: nn.Module, loaded: Loaded, shard_index: int | None) -> None:
        """Put one checkpoint tensor (this rank's slice of it, cut by the layer on group boundaries)
        into its place: part `shard_index` of a fused layer, or the whole weight for None."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every part is loaded: quantize or pack for the kernel (once)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T + b` (traced: pure tensor code)."""

    def before_input_split(self, loaded: Loaded) -> Loaded:
        """A whole checkpoint weight whose input columns tensor parallelism splits over ranks
        (row-parallel layers), before the layer cuts this rank's columns: a method that quantizes
        at load quantizes it whole here, so every rank keeps the groups (and, per channel, the
        scales) one rank would, and TP=N computes with the weights of TP=1. Default: as it is."""
        return loaded

    def packed_state(self, layer: nn.Module) -> dict[str, torch.Tensor | int] | None:
        """After `process_weights_after_loading`: what it made, where that is all the layer needs to
        run (stored in the compile cache entry, so that a warm start neither reads this layer's
        checkpoint tensors nor packs them again); None (default) where the layer needs more."""
        return None

    def restore_packed(self, layer: nn.Module, state: dict[str, torch.Tensor | int]) -> None:
        """Take back what `packed_state` returned, in place of loading and processing."""
        raise NotImplementedError(f"{type(self).__name__} stores no packed state")

    def tie(self, layer: nn.Module, embedding: nn.Parameter) -> None:  # noqa: B027 (an optional hook)
        """The LM head of a model with tied embeddings: share the embedding's parameter where the
        method keeps the weight as it is (default: nothing; the loader gives the head the
        embedding's checkpoint tensor too, which the method stores its own way)."""


class EmbeddingMethod(ABC):
    """How an embedding table arrives quantized is kept and looked up (a GGUF file's blocks)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        """Register the table's buffers."""

    @abstractmethod
    def load(self, layer: nn.Module, loaded: Loaded) -> None:
        """This rank's rows of the table."""

    @abstractmethod
    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` in the model's dtype (traced: pure tensor code)."""


class QuantizationConfig(ABC):
    """One weight format for a whole model: which `LinearMethod` each linear layer gets."""

    name: ClassVar[str]

    @classmethod
    def from_model_config(cls, model_config: ModelConfig) -> QuantizationConfig:
        """The method's config for a model: by default from its `quantization_options` (a method
        whose parameters are in the checkpoint reads them there)."""
        return cls(dict(model_config.quantization_options))  # type: ignore[call-arg]

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod | None:
        """The method of the layer called `prefix` ("model.layers.0.self_attn.qkv_proj", "lm_head");
        None leaves that layer's weight as it is (`UnquantizedLinearMethod`), as vLLM's configs do."""

    def embedding_method(self, prefix: str) -> EmbeddingMethod | None:
        """The method of the embedding `prefix` ("model.embed_tokens"); None: a float table."""
        return None

    @abstractmethod
    def cache_factors(self) -> dict[str, Any]:
        """What the compile-cache key must hold: the method and every parameter of it."""

    @abstractmethod
    def describe(self) -> str:
        """For the start-up log: what each kind of layer got."""


def part_rows(layer: nn.Module, shard_index: int | None) -> tuple[int, int]:
    """(first row, rows) of part `shard_index` of a fused layer's output (all rows for None)."""
    sizes: list[int] = layer.output_sizes
    if shard_index is None:
        return 0, sum(sizes)
    return sum(sizes[:shard_index]), sizes[shard_index]


def copy_part(layer: nn.Module, loaded: torch.Tensor, shard_index: int | None) -> None:
    """Copy a float checkpoint tensor into its rows of the layer's float `weight` (part
    `shard_index` of a fused layer, or all of it)."""
    start, rows = part_rows(layer, shard_index)
    target = layer.weight.data.narrow(0, start, rows)
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {tuple(target.shape)}")
    target.copy_(loaded)


def narrow_weight(loaded: Loaded, dim: int, start: int, length: int) -> Loaded:
    """`length` rows (dim 0) or columns (dim 1) of a weight from `start`. A quantized weight is cut
    on group boundaries only (a group never straddles two ranks), or anywhere if per channel."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    q, scales, mins, size = loaded.q, loaded.scales, loaded.mins, loaded.group_size
    if dim == 0:
        return QuantizedWeight(q.narrow(0, start, length), scales.narrow(0, start, length),
                               None if mins is None else mins.narrow(0, start, length), loaded.bits, size)
    in_features = q.shape[1]
    if scales.shape[1] == 1:  # one scale per output channel: any columns keep it
        return QuantizedWeight(q.narrow(1, start, length), scales, mins, loaded.bits, length)
    if start % size or (length % size and start + length != in_features):
        raise ValueError(
            f"Cannot cut columns {start}..{start + length} of a weight quantized in groups of {size}: a group "
            f"would straddle two tensor-parallel ranks (choose a group size that divides {start or length})."
        )
    first, groups = start // size, -(-length // size)
    return QuantizedWeight(q.narrow(1, start, length), scales.narrow(1, first, groups),
                           None if mins is None else mins.narrow(1, first, groups), loaded.bits, size)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in the packed fp32 GEMM's panel layout (a copy; the C++ kernels must be built)."""
    return torch.ops.compiled_llm_cpu.pack_linear_weight(weight.detach(), 0)


class UnquantizedLinearMethod(LinearMethod):
    """The weight as the checkpoint has it, in the model's dtype. On a CPU with the C++ kernels
    (float32) it is also packed once, after loading, into the panel layout of the packed GEMM
    (kernels/csrc/cpu_gemm.cpp), and the forward calls that op: the traced graph holds an opaque op
    whose packed weight is an input like any parameter, so compiled artifacts do not depend on the
    weights' values, and every row count streams the weight sequentially. Elsewhere: `F.linear`."""

    def __init__(self, cpu_kernel: bool = False) -> None:
        """`cpu_kernel`: the C++ CPU kernels are built and the model runs in float32 on a CPU."""
        self.cpu_kernel = cpu_kernel

    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(sum(output_sizes), in_features, dtype=params_dtype),
                                    requires_grad=False)
        layer.register_buffer("packed_weight", None, persistent=False)  # made after loading (CPU kernels)

    def load(self, layer: nn.Module, loaded: Loaded, shard_index: int | None) -> None:
        if isinstance(loaded, QuantizedWeight):
            raise ValueError("a quantized checkpoint tensor needs its quantization method, not the float one")
        copy_part(layer, loaded, shard_index)
        layer.packed_weight = None  # stale until packed again

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if self.cpu_kernel and weight.dtype == torch.float32 and weight.device.type == "cpu":
            layer.packed_weight = pack_weight(weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed_weight is not None:
            return torch.ops.compiled_llm_cpu.packed_linear(x, layer.packed_weight, bias, layer.weight.shape[0])
        return F.linear(x, layer.weight, bias)

    def tie(self, layer: nn.Module, embedding: nn.Parameter) -> None:
        layer.weight = embedding

