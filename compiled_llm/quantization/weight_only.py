"""Weight-only quantized linears: the weight kept in the group-wise 8- or 4-bit format of
kernels/quantized_reference.py (`QuantizedWeight`), activations in float.

The method behind `int8`, `int4` (quantized at load from any float checkpoint, part by part, so no
float copy of the model is ever held) and any format that arrives quantized (a GGUF block tensor
is a `QuantizedWeight` already). After loading, the parts are stacked and, on a CPU with the C++
kernels, packed once for `compiled_llm_cpu::quantized_linear`, which de-quantizes in registers
inside the GEMM; on a GPU with Triton, laid out for `compiled_llm::quant_gemm`
(kernels/gpu_quant_linear.py), the Triton GEMM that does the same. Elsewhere (no kernels) the
forward is `x @ dequant(W)^T` in plain torch, which Inductor compiles into the piece.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compiled_llm.kernels.cpu_extension import cpu_kernels_available
from compiled_llm.kernels.gpu_quant_linear import gpu_layout, triton_available
from compiled_llm.kernels.quantized_reference import QuantizedWeight, quantize_int4, quantize_int8
from compiled_llm.quantization.base import LinearMethod, Loaded, part_rows


def cpu_op_available(name: str) -> bool:
    """Whether the C++ CPU kernels are built and hold `compiled_llm_cpu::<name>`."""
    return cpu_kernels_available() and hasattr(torch.ops.compiled_llm_cpu, name)


def uses_quantized_kernel(device: torch.device, dtype: torch.dtype, in_features: int) -> bool:
    """The C++ GEMM takes float32 activations on a CPU, and inputs in multiples of 32."""
    return (device.type == "cpu" and dtype == torch.float32 and in_features % 32 == 0
            and cpu_op_available("quantized_linear"))


def quantizes_activations(bits: int, panel: int = 0) -> bool:
    """Whether the C++ GEMM multiplies this many bits of weights, packed in panels `panel` wide (0:
    the CPU's native width), with activations quantized to int8 per block of 32 (4-bit weights in
    16-wide panels on AVX2; 8- and 4-bit ones in 32-wide panels with AVX512-VNNI: see
    `quantized_reference.int8_activations`), rather than with the float32 activations."""
    if not cpu_op_available("quantized_linear_int8_activations"):
        return False
    ops = torch.ops.compiled_llm_cpu
    return ops.quantized_linear_int8_activations(bits, panel or ops.native_panel_width())


def uses_triton_kernel(device: torch.device) -> bool:
    """A GPU computes with the Triton GEMM (kernels/triton_quant_gemm.py) where Triton is installed."""
    return device.type == "cuda" and triton_available()


def quantize(weight: torch.Tensor, bits: int, group_size: int | None) -> QuantizedWeight:
    """`group_size` None: one group per output channel (8-bit only)."""
    if bits == 8:
        return quantize_int8(weight, group_size)
    if group_size is None:
        raise ValueError("4-bit weights need a group size")
    return quantize_int4(weight, group_size)


def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The fused parts (q, k, v; gate, up) of one layer, stacked along the output features."""
    first = parts[0]
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), mins,
                           first.bits, first.group_size)


class WeightOnlyLinearMethod(LinearMethod):
    """`bits` 8 or 4 in groups of `group_size` inputs (None: per output channel), float activations."""

    def __init__(self, bits: int, group_size: int | None) -> None:
        self.bits, self.group_size = bits, group_size

    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        layer.quantized_parts = {}  # shard index -> QuantizedWeight, until process_weights_after_loading
        layer.params_dtype = params_dtype
        layer.weight_device = torch.empty(0).device  # the device the model is built on
        layer.triton_kernel = False  # set after loading where the Triton GEMM runs
        for name in ("packed_weight", "qweight", "scales", "mins"):
            layer.register_buffer(name, None, persistent=False)

    def before_input_split(self, loaded: Loaded) -> Loaded:
        return self._quantized(loaded)

    def load(self, layer: nn.Module, loaded: Loaded, shard_index: int | None) -> None:
        weight = self._quantized(loaded)
        _, rows = part_rows(layer, shard_index)
        if tuple(weight.shape) != (rows, layer.in_features):
            raise ValueError(f"shape mismatch: checkpoint {tuple(weight.shape)} vs model {(rows, layer.in_features)}")
        layer.quantized_parts[shard_index] = weight

    def _quantized(self, loaded: Loaded) -> QuantizedWeight:
        if isinstance(loaded, QuantizedWeight):
            if loaded.bits != self.bits:
                raise ValueError(f"a {loaded.bits}-bit checkpoint tensor cannot load into a {self.bits}-bit layer")
            return loaded
        return quantize(loaded, self.bits, self.group_size or None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = layer.quantized_parts
        if not parts:
            return  # processed already
        weight = stack([parts[i] for i in sorted(parts, key=lambda i: -1 if i is None else i)])
        layer.quantized_parts = {}
        layer.group_size = weight.group_size
        device = layer.weight_device
        if uses_quantized_kernel(device, layer.params_dtype, layer.in_features):
            layer.packed_weight = torch.ops.compiled_llm_cpu.pack_quantized_weight(
                weight.q, weight.scales, weight.mins, weight.bits, weight.group_size, 0)
            return
        if uses_triton_kernel(device):
            layer.qweight, layer.scales, layer.mins = gpu_layout(weight, device)
            layer.triton_kernel = True
            return
        layer.qweight = weight.q.to(device)
        layer.scales = weight.scales.to(device, layer.params_dtype)
        layer.mins = None if weight.mins is None else weight.mins.to(device, layer.params_dtype)

    def packed_state(self, layer: nn.Module) -> dict[str, torch.Tensor | int] | None:
        if layer.packed_weight is None:  # the Triton and plain-torch layouts are quick to make
            return None
        return {"packed_weight": layer.packed_weight, "group_size": layer.group_size}

    def restore_packed(self, layer: nn.Module, state: dict[str, torch.Tensor | int]) -> None:
        layer.quantized_parts = {}
        layer.packed_weight, layer.group_size = state["packed_weight"], state["group_size"]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed_weight is not None:
            return torch.ops.compiled_llm_cpu.quantized_linear(
                x, layer.packed_weight, bias, layer.out_features, layer.in_features, self.bits, layer.group_size)
        if layer.triton_kernel:
            return torch.ops.compiled_llm.quant_gemm(x, layer.qweight, layer.scales, layer.mins, bias, self.bits,
                                                     layer.group_size)
        return F.linear(x, dequantized(layer), bias)


def dequantized(layer: nn.Module) -> torch.Tensor:
    """The layer's float weight [N, K] from its q, scales and mins (traced: Inductor fuses it)."""
    k, size = layer.in_features, layer.group_size
    groups = layer.scales.shape[1]
    scales = layer.scales.repeat_interleave(size, dim=1, output_size=groups * size)[:, :k]
    w = layer.qweight.to(scales.dtype) * scales
    if layer.mins is not None:
        w = w + layer.mins.repeat_interleave(size, dim=1, output_size=groups * size)[:, :k]
    return w
