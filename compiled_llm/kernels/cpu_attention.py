"""Paged attention on a CPU.

The torch code here is the reference (for the Triton kernels and the C++ kernels) and the
fallback. When the C++ kernels are built (kernels/cpu_extension.py), float32 KV writes and
decode attention go through them: they read the paged cache in place instead of gathering it.

KV-cache layout: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, then values).
A token's slot is `block_id * block_size + offset`; block 0 is the null block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_llm.kernels.cpu_extension import cpu_kernels_available
from compiled_llm.kernels.metadata import AttentionMetadata
from compiled_llm.kernels.rotary import rotary_embedding


def _use_cpp(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.float32 and cpu_kernels_available()


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> None:
    """One layer's attention for a step, into `output`: the new keys and values written to the
    cache, then every query attended over its request's context. With `positions` and
    `cos_sin_cache` (the rotary fusion pass), the queries and keys are rotated here first.

    With the C++ kernels it is one call (`compiled_llm_cpu::attention_step`): done op by op from
    here it cost about 70 us of Python a layer, more than a batch-1 decode's attention itself.
    """
    head_dim = query.shape[2]
    if (_use_cpp(kv_cache) and query.stride(1) == head_dim and key.stride(1) == head_dim
            and value.stride(1) == head_dim):
        torch.ops.compiled_llm_cpu.attention_step.default(
            query, key, value, output, kv_cache, metadata.slot_mapping, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, metadata.num_reqs, metadata.num_decodes, metadata.num_actual_tokens, scale,
            positions, cos_sin_cache,
        )
        return
    if positions is not None:
        query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    paged_attention(query, key, value, kv_cache, metadata, scale, output=output)


def attention_qkv(
    qkv: torch.Tensor,
    output: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """`attention` of the queries, keys and values split from the fused QKV output `qkv`
    [T, (H + 2 Hkv) D] (H and D from `output`), rotated by `positions` first."""
    num_heads, head_dim = output.shape[1], output.shape[2]
    if _use_cpp(kv_cache) and qkv.stride(1) == 1:
        torch.ops.compiled_llm_cpu.attention_step_qkv.default(
            qkv, output, kv_cache, metadata.slot_mapping, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, metadata.num_reqs, metadata.num_decodes, metadata.num_actual_tokens, scale,
            num_kv_heads, positions, cos_sin_cache,
        )
        return
    heads = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    query, key, value = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    attention(query, key, value, output, kv_cache, metadata, scale, positions, cos_sin_cache)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, reference: bool = False
) -> None:
    """Store each token's key and value at its slot; a slot of -1 (padding) writes nothing."""
    if not reference and _use_cpp(kv_cache) and key.stride(1) == key.shape[2] and value.stride(1) == value.shape[2]:
        torch.ops.compiled_llm_cpu.write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping[: key.shape[0]])
        return
    num_kv_heads, head_dim = key.shape[-2:]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    key_cache.index_copy_(0, slot_mapping, key)
    value_cache.index_copy_(0, slot_mapping, value)


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The first `num_tokens` cached vectors of one request: [num_tokens, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache[block_table[:num_blocks]]
    return blocks.view(num_blocks * block_size, *cache.shape[2:])[:num_tokens]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    output: torch.Tensor | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """Causal attention of every query token over its request's cached context and itself.

    `query` is [num_tokens, num_heads, head_dim]; `key` and `value` are the new tokens'
    [num_tokens, num_kv_heads, head_dim], already written to the cache by `write_kv_cache`.
    Returns [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    gqa = num_heads != num_kv_heads
    if output is None:
        output = torch.empty_like(query)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    block_size = key_cache.shape[1]
    seq_lens = metadata.seq_lens_cpu
    starts = metadata.query_start_loc_cpu

    num_decodes = metadata.num_decodes
    if num_decodes and not reference and _use_cpp(kv_cache) and query.stride(1) == head_dim:
        torch.ops.compiled_llm_cpu.paged_decode_attention(
            output[:num_decodes], query[:num_decodes], key_cache, value_cache,
            metadata.block_tables[:num_decodes], metadata.seq_lens[:num_decodes], scale,
        )
    elif num_decodes:
        # All single-token queries in one batched call over their gathered, padded contexts.
        max_len = int(seq_lens[:num_decodes].max())
        num_blocks = -(-max_len // block_size)
        tables = metadata.block_tables[:num_decodes, :num_blocks]
        padded = num_blocks * block_size
        k = key_cache[tables].view(num_decodes, padded, num_kv_heads, head_dim).transpose(1, 2)
        v = value_cache[tables].view(num_decodes, padded, num_kv_heads, head_dim).transpose(1, 2)
        lens = metadata.seq_lens[:num_decodes].to(torch.int64)
        mask = torch.arange(padded, device=query.device)[None, :] < lens[:, None]
        q = query[:num_decodes].view(num_decodes, num_heads, 1, head_dim)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa
        )
        output[:num_decodes] = out.view(num_decodes, num_heads, head_dim)

    if metadata.num_reqs > num_decodes and not reference and _use_cpp(kv_cache) and query.stride(1) == head_dim:
        torch.ops.compiled_llm_cpu.paged_prefill_attention(
            output, query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, num_decodes, scale,
        )
        prefills = range(0)
    else:
        prefills = range(num_decodes, metadata.num_reqs)
    for i in prefills:
        start, end = int(starts[i]), int(starts[i + 1])
        query_len, seq_len = end - start, int(seq_lens[i])
        if query_len == 0:
            continue  # a padded request (CUDA-graph padding): no tokens

        context_len = seq_len - query_len
        if context_len == 0:
            k, v = key[start:end], value[start:end]
        else:
            k = _gather_context(key_cache, metadata.block_tables[i], seq_len)
            v = _gather_context(value_cache, metadata.block_tables[i], seq_len)
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        if context_len == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # Bottom-right aligned causal mask: query j sees keys up to context_len + j.
            rows = torch.arange(query_len, device=query.device)[:, None] + context_len
            mask = torch.arange(seq_len, device=query.device)[None, :] <= rows
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        output[start:end] = out[0].transpose(0, 1)
    if metadata.num_actual_tokens < num_tokens:
        output[metadata.num_actual_tokens :].zero_()  # padded tokens: defined, never NaN
    return output
