"""LoRA on the decoder's linears: a wrapper that adds each token's adapter update to its base
layer's output, built only when the engine has LoRA enabled.

Every wrapped layer holds preallocated stacks, `lora_a` [max_loras, S * R, in] and `lora_b`
[max_loras, R, out] (R = max_lora_rank, S sub-projections of a fused layer; B is transposed once,
when an adapter is written into its slot, so the kernels' expand runs along the outputs; float16
under the C++ CPU kernels by default, see `lora_stack_dtype`), and reads
one shared per-token slot-index tensor and one per-slot scaling tensor. All are buffers, bound into
the compiled graph like the weights: loading an adapter writes into a slot in place, so no shape, no
address and no compiled piece depends on which adapters a batch holds.

Fused layers keep each sub-projection's adapter on its own slice of the output (q, k, v; gate, up):
A's rows hold one R block per sub-projection, and `lora_expand` sends output slice j through block
j. Under tensor parallelism the matrices split with their base layer: a column-parallel layer keeps
B's rows (Bt's columns) for its output slice (A whole); a row-parallel layer keeps A's columns for
its input slice, and the rank-R partial products are summed over the ranks before the expand (with B
whole), after the base layer's own all-reduce.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

import compiled_llm.kernels.lora  # noqa: F401  (registers compiled_llm::lora_shrink / lora_expand)
from compiled_llm.distributed.communication import all_reduce
from compiled_llm.models.layers.parallel import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

# The fused layer's name -> its PEFT sub-module names, in the order of its output slices.
SUB_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_LAYER = re.compile(r"layers\.(\d+)\.")


class LoRALinear(nn.Module):
    """`base(x)` plus, for each token whose slot is >= 0, `scaling * x A^T B^T` of that slot."""

    def __init__(self, base: nn.Module, layer: int, modules: tuple[str, ...], max_loras: int, max_rank: int,
                 indices: torch.Tensor, scalings: torch.Tensor, stack_dtype: torch.dtype, cpu_kernels: bool) -> None:
        super().__init__()
        self.base, self.layer, self.modules = base, layer, modules
        self.rank = max_rank
        self.row_parallel = isinstance(base, RowParallelLinear) and base.parallel
        self.slices = list(base.output_sizes) if len(modules) > 1 else [base.out_features]
        device, dtype = indices.device, stack_dtype
        self.register_buffer("lora_a", torch.zeros(max_loras, len(modules) * max_rank, base.in_features,
                                                   device=device, dtype=dtype), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, base.out_features, device=device,
                                                   dtype=dtype), persistent=False)
        self.register_buffer("lora_indices", indices, persistent=False)
        self.register_buffer("lora_scalings", scalings, persistent=False)
        # The C++ kernels take float32 activations with float32 or float16 stacks, and add into the
        # base layer's output in place; anything else takes the generic ops.
        self.cpu_kernels = cpu_kernels and scalings.dtype == torch.float32 and dtype in (torch.float32, torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        ops = torch.ops.compiled_llm_cpu if self.cpu_kernels else torch.ops.compiled_llm
        t = ops.lora_shrink(x, self.lora_a, self.lora_indices)
        if self.row_parallel:  # each rank holds A's columns for its input slice
            t = all_reduce(t)
        if self.cpu_kernels:
            ops.lora_expand_(y, t, self.lora_b, self.lora_scalings, self.lora_indices, self.slices)
            return y
        return ops.lora_expand(y, t, self.lora_b, self.lora_scalings, self.lora_indices, self.slices)

    def _local(self, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of sub-projection `part`'s A [r, in] and B [out, r]."""
        base = self.base
        if isinstance(base, RowParallelLinear):
            cols = base.in_columns
            return a[:, cols.start : cols.stop], b
        if isinstance(base, QKVParallelLinear):
            rows = base._rows(part)
        elif isinstance(base, MergedColumnParallelLinear):
            rows = base.part_rows[part]
        else:
            rows = range(0, b.shape[0])
        return a, b[rows.start : rows.stop]

    def set_slot(self, slot: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's matrices into `slot` (sub-modules it does not target stay zero)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        start = 0
        for j, module in enumerate(self.modules):
            size = self.slices[j]
            if module in parts:
                a, b = self._local(j, *parts[module])
                r = a.shape[0]
                if a.shape[1] != self.lora_a.shape[2] or b.shape[0] != size:
                    raise ValueError(
                        f"layer {self.layer} {module}: adapter shapes A {tuple(parts[module][0].shape)}, "
                        f"B {tuple(parts[module][1].shape)} do not fit the model's projection "
                        f"({self.lora_a.shape[2]} inputs, {size} outputs on this rank)")
                self.lora_a[slot, j * self.rank : j * self.rank + r] = a
                self.lora_b[slot, :r, start : start + size] = b.t()
            start += size

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()


def lora_stack_dtype(lora_dtype: str, activations: torch.dtype, cpu_kernels: bool) -> torch.dtype:
    """The slots' dtype for `LoRAConfig.lora_dtype` (config.py says why "auto" is float16 under the
    C++ CPU kernels)."""
    if lora_dtype == "auto":
        return torch.float16 if cpu_kernels and activations == torch.float32 else activations
    return getattr(torch, lora_dtype)


def install_lora(model: nn.Module, max_loras: int, max_rank: int, indices: torch.Tensor, dtype: torch.dtype,
                 stack_dtype: torch.dtype, cpu_kernels: bool) -> tuple[list[LoRALinear], torch.Tensor]:
    """Wrap every attention and MLP projection of `model` (after its weights are loaded) in a
    `LoRALinear` reading the slot of each token from `indices` (the runner fills it every step).
    `dtype`: the activations'; `stack_dtype`: the adapters' in their slots. Returns the wrappers and
    the shared per-slot scaling tensor."""
    scalings = torch.zeros(max_loras, dtype=dtype, device=indices.device)
    wrapped = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        match = _LAYER.search(name)
        if leaf not in SUB_MODULES or match is None:
            continue
        parent_name, _ = name.rsplit(".", 1)
        parent: Any = model.get_submodule(parent_name)
        lora = LoRALinear(module, int(match.group(1)), SUB_MODULES[leaf], max_loras, max_rank, indices, scalings,
                          stack_dtype, cpu_kernels)
        setattr(parent, leaf, lora)
        wrapped.append(lora)
    return wrapped, scalings
