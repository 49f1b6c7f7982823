"""A toy model for the compilation tests: identical layers around a stand-in attention op.

The op is registered under its own name (`toy_attn::attention`) and configured as the
splitting op by name, exercising that the split is configurable. Its Python implementation
counts calls, so tests can see it run eagerly between the compiled pieces.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 16
CALLS = {"attention": 0}

_lib = torch.library.Library("toy_attn", "FRAGMENT")
_lib.define("attention(Tensor x, Tensor(a!) state) -> Tensor")


def _attention(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    CALLS["attention"] += 1
    # Mixes tokens (a causal running mean), so splitting it out of a piece is observable.
    return x.cumsum(0) / torch.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None] + state


_lib.impl("attention", _attention, "CPU")
torch.library.register_fake("toy_attn::attention", lambda x, state: torch.empty_like(x), lib=_lib)

SPLITTING_OPS = ["toy_attn::attention"]


class ToyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.register_buffer("state", torch.zeros(HIDDEN), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.up(x))
        h = torch.ops.toy_attn.attention(h[:, :HIDDEN] * h[:, HIDDEN:], self.state)
        return x + self.down(torch.cat([h, h * 0.5], dim=-1))


class ToyModel(nn.Module):
    def __init__(self, num_layers: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(ToyLayer() for _ in range(num_layers))
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + positions[:, None].to(x.dtype) * 0.01
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def inputs(num_tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + num_tokens)
    return torch.randn(num_tokens, HIDDEN, generator=g), torch.arange(num_tokens)
