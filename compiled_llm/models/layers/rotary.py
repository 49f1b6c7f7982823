"""Rotary position embeddings (NeoX layout, as Llama and Qwen use), with llama3 and linear scaling.

The rotation is the op `compiled_llm::rotary_embedding`, implemented for every backend by its
decomposition (CompositeImplicitAutograd): Inductor sees plain tensor code and fuses it as before,
while the traced graph keeps one recognisable node that a fusion pass can fold into the attention
op that consumes it (compilation/rotary_attention_fusion.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from compiled_llm.kernels.rotary import rotary_embedding

_lib = torch.library.Library("compiled_llm", "FRAGMENT")
_lib.define("rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache) -> (Tensor, Tensor)")
_lib.impl("rotary_embedding", rotary_embedding, "CompositeImplicitAutograd")


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _cos_sin_table(freqs: torch.Tensor) -> torch.Tensor:
    """[cos | sin] of float64 `freqs`, rounded to float32, the same bits on every build. numpy's,
    not torch's: torch's float64 cos and sin on the CPU split the work over threads, and a worker
    thread's first call in a process can run at about half of float64's precision (torch 2.13,
    MKL; one process in ten here), so two builds of one model disagreed in the table's last bit."""
    angles = freqs.numpy()
    return torch.from_numpy(np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32))


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys by their positions, from a precomputed cos/sin table."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, theta)
        positions = torch.arange(max_position, dtype=torch.float64, device="cpu")  # the table is built here
        kind = scaling["rope_type"] if scaling else "default"
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
        elif kind == "linear":
            positions = positions / scaling["factor"]  # type: ignore[index]
        elif kind != "default":
            raise ValueError(f"Unsupported rope scaling type {kind!r}; supported: default, linear, llama3.")
        cache = _cos_sin_table(torch.outer(positions, inv_freq)).to(torch.get_default_device())  # the model's
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`query` [T, H, D] and `key` [T, Hkv, D] rotated by `positions` [T]."""
        return torch.ops.compiled_llm.rotary_embedding(positions, query, key, self.cos_sin_cache)
