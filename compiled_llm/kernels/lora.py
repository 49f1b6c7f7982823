"""Batched LoRA: each token of a flat batch applies its own adapter's low-rank update, as Punica
and S-LoRA do, in two products (shrink, then expand) indexed by a per-token slot.

    shrink:  t = x @ A[slot]^T                     A:  [L, S * R, K] -> t: [T, S * R]
    expand:  out = y + scale[slot] * t_j @ Bt[slot]  Bt: [L, R, N], output slice j reads t's j-th R block

`L` slots, `R` the largest rank (smaller adapters are zero-padded), `S` sub-projections of a fused
layer (QKV: 3, gate-up: 2, others 1) with output sizes `slices`. B is stored transposed, [R, N] a
slot (written so when an adapter is loaded), so every path's expand runs along the outputs. A slot
of -1 (the base model, padding) adds nothing. The ops `compiled_llm::lora_shrink` and
`compiled_llm::lora_expand` are what the LoRA layers call: opaque to Dynamo, so a compiled piece
calls them with the slot indices as an input and never depends on which adapters a batch holds. On a
CPU they run the torch reference here (the C++ kernels, `compiled_llm_cpu::lora_shrink` and the
in-place `compiled_llm_cpu::lora_expand_`, are called directly by layers that use the C++ kernels);
on a GPU the Triton kernels (kernels/triton_lora.py). The stacks may be of another dtype than the
activations (float16 under float32 activations): they are converted to the activations' dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch


def lora_shrink_reference(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`t[i] = x[i] @ A[indices[i]]^T`, zero where the slot is negative; one matmul per slot."""
    num_tokens = x.shape[0]
    idx = indices[:num_tokens]
    out = x.new_zeros(num_tokens, lora_a.shape[1])
    for slot in torch.unique(idx).tolist():
        if slot < 0:
            continue
        rows = idx == slot
        out[rows] = (x[rows] @ lora_a[slot].t().to(x.dtype)).to(out.dtype)
    return out


def lora_expand_reference(
    y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, scalings: torch.Tensor, indices: torch.Tensor,
    slices: Sequence[int],
) -> torch.Tensor:
    """`y` plus each token's `scale * t_j @ Bt[slot]` on output slice j; unchanged where the slot is negative."""
    rank = lora_b.shape[1]
    idx = indices[: y.shape[0]]
    out = y.clone(memory_format=torch.contiguous_format)
    for slot in torch.unique(idx).tolist():
        if slot < 0:
            continue
        rows = idx == slot
        start = 0
        for j, size in enumerate(slices):
            bt = lora_b[slot, :, start : start + size].to(t.dtype)
            delta = t[rows, j * rank : (j + 1) * rank] @ bt * scalings[slot].to(t.dtype)
            out[rows, start : start + size] += delta.to(out.dtype)
            start += size
    return out


_lib = torch.library.Library("compiled_llm", "FRAGMENT")
_lib.define("lora_shrink(Tensor x, Tensor lora_a, Tensor indices) -> Tensor")
_lib.define("lora_expand(Tensor y, Tensor t, Tensor lora_b, Tensor scalings, Tensor indices, int[] slices) -> Tensor")


def _shrink_cuda(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    from compiled_llm.kernels.triton_lora import lora_shrink

    return lora_shrink(x, lora_a, indices)


def _expand_cuda(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, scalings: torch.Tensor,
                 indices: torch.Tensor, slices: Sequence[int]) -> torch.Tensor:
    from compiled_llm.kernels.triton_lora import lora_expand

    return lora_expand(y, t, lora_b, scalings, indices, slices)


def _shrink_fake(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], lora_a.shape[1])


def _expand_fake(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, scalings: torch.Tensor,
                 indices: torch.Tensor, slices: Sequence[int]) -> torch.Tensor:
    return torch.empty_like(y, memory_format=torch.contiguous_format)


_lib.impl("lora_shrink", lora_shrink_reference, "CPU")
_lib.impl("lora_expand", lora_expand_reference, "CPU")
_lib.impl("lora_shrink", _shrink_cuda, "CUDA")
_lib.impl("lora_expand", _expand_cuda, "CUDA")
torch.library.register_fake("compiled_llm::lora_shrink", _shrink_fake, lib=_lib)
torch.library.register_fake("compiled_llm::lora_expand", _expand_fake, lib=_lib)
