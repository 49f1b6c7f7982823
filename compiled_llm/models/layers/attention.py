"""The attention custom op, `compiled_llm::attention`, and the layer that calls it.

The op is the seam the compiler splits the graph around: everything between two attention
calls is compiled, the op itself runs eagerly. It takes only tensors and the softmax scale
(no layer names): the layer's own KV cache is passed in as a tensor (a non-persistent buffer
of the layer), and the step's metadata comes from the forward context. It writes into an
`output` the layer allocates before the call, so under piecewise CUDA graphs the buffer is an
output of the previous captured piece and keeps its address from replay to replay.
"""

from __future__ import annotations

import torch
from torch import nn

from compiled_llm.compilation.forward_context import get_forward_context
from compiled_llm.kernels.cpu_attention import attention as cpu_attention
from compiled_llm.kernels.cpu_attention import attention_qkv as cpu_attention_qkv

_lib = torch.library.Library("compiled_llm", "FRAGMENT")
_lib.define(
    "attention(Tensor query, Tensor key, Tensor value, Tensor(a!) output, Tensor(b!) kv_cache, float scale, "
    "Tensor? positions=None, Tensor? cos_sin_cache=None) -> ()"
)
_lib.define(
    "attention.qkv(Tensor qkv, Tensor(a!) output, Tensor(b!) kv_cache, float scale, int num_kv_heads, "
    "Tensor positions, Tensor cos_sin_cache) -> ()"
)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, (H + 2 Hkv) D] -> views [T, H, D], [T, Hkv, D], [T, Hkv, D], as the model's split makes."""
    heads = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    return (heads.narrow(1, 0, num_heads), heads.narrow(1, num_heads, num_kv_heads),
            heads.narrow(1, num_heads + num_kv_heads, num_kv_heads))


def _attention_cpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor,
    scale: float, positions: torch.Tensor | None = None, cos_sin_cache: torch.Tensor | None = None,
) -> None:
    cpu_attention(query, key, value, output, kv_cache, get_forward_context().attn_metadata, scale, positions,
                  cos_sin_cache)


def _attention_cuda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor,
    scale: float, positions: torch.Tensor | None = None, cos_sin_cache: torch.Tensor | None = None,
) -> None:
    from compiled_llm.kernels.triton_attention import rope_write_kv_cache, unified_attention, write_kv_cache

    metadata = get_forward_context().attn_metadata
    if positions is None:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    else:  # one kernel: rotate the queries (into a new buffer) and keys, write keys and values
        query = rope_write_kv_cache(query, key, value, kv_cache, metadata.slot_mapping, positions, cos_sin_cache)
    unified_attention(query, kv_cache, metadata, scale, output=output)


def _attention_qkv_cpu(
    qkv: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor, scale: float, num_kv_heads: int,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> None:
    cpu_attention_qkv(qkv, output, kv_cache, get_forward_context().attn_metadata, scale, num_kv_heads, positions,
                      cos_sin_cache)


def _attention_qkv_cuda(
    qkv: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor, scale: float, num_kv_heads: int,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> None:
    query, key, value = split_qkv(qkv, output.shape[1], num_kv_heads, output.shape[2])
    _attention_cuda(query, key, value, output, kv_cache, scale, positions, cos_sin_cache)


def _attention_qkv_fake(
    qkv: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor, scale: float, num_kv_heads: int,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> None:
    return None


def _attention_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor,
    scale: float, positions: torch.Tensor | None = None, cos_sin_cache: torch.Tensor | None = None,
) -> None:
    return None


_lib.impl("attention", _attention_cpu, "CPU")
_lib.impl("attention", _attention_cuda, "CUDA")
torch.library.register_fake("compiled_llm::attention", _attention_fake, lib=_lib)
_lib.impl("attention.qkv", _attention_qkv_cpu, "CPU")
_lib.impl("attention.qkv", _attention_qkv_cuda, "CUDA")
torch.library.register_fake("compiled_llm::attention.qkv", _attention_qkv_fake, lib=_lib)


class Attention(nn.Module):
    """Multi-head attention over the paged KV cache (GQA when num_kv_heads < num_heads)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Replaced by the model runner with this layer's slice of the KV cache.
        self.register_buffer("kv_cache", torch.empty(0), persistent=False)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """[T, H, D] queries, [T, Hkv, D] keys and values -> [T, H * D]."""
        output = torch.empty_like(query)
        torch.ops.compiled_llm.attention(query, key, value, output, self.kv_cache, self.scale)
        return output.view(-1, self.num_heads * self.head_dim)
