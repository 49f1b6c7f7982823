"""Rotary position embeddings, NeoX layout (as Llama, Qwen and SmolLM2 use): the reference.

`cos_sin_cache` is float32 [max_position, head_dim]: the cosines of a position in the first half
of its row, the sines in the second. A head's vector is rotated as two halves, in float32, and
cast back to its dtype. The fused kernels (the C++ attention step, the Triton KV-cache write) do
the same arithmetic and are tested against this.
"""

from __future__ import annotations

import torch


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` [T, heads, D] rotated by `cos`/`sin` [T, 1, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`query` [T, H, D] and `key` [T, Hkv, D] rotated by `positions` [T]."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return rotate_neox(query, cos, sin), rotate_neox(key, cos, sin)
