"""Triton kernels for GPUs: the paged KV-cache write and one attention kernel for mixed batches.

Same semantics as kernels/cpu_attention.py, the reference. Both kernels size their launch grids
from tensor shapes and never read a value back to the host, so a CUDA graph can capture them and
replay them with new contents in the same buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled_llm.kernels.metadata import AttentionMetadata

_LOG2_E = 1.4426950408889634
# Key tile of the attention loop, independent of the cache's block size (block 8 still gives
# tl.dot tiles of at least 16).
_TILE_N = 64
# Query rows (query tokens x heads of one KV head's group) per program. Decode-heavy batches use
# the smallest tile tl.dot accepts; prefill-heavy ones a larger tile that reads each key once for
# more queries.
_DECODE_ROWS = 16
_PREFILL_ROWS = 64
# A batch averaging fewer query tokens per request than this is treated as decode-heavy.
_PREFILL_MIN_AVG_QUERY = 4


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_c_dim,
    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr,
):
    """One program per token: copy its [num_kv_heads, head_dim] key and value into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, DIM)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot
           + heads * stride_c_head + dims * stride_c_dim)
    tl.store(dst, key, mask=mask)
    tl.store(dst + stride_c_kv, value, mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's key and value at its slot; a slot of -1 (padding) writes nothing.

    `key`/`value`: [num_tokens, num_kv_heads, head_dim]; `kv_cache`: [2, num_blocks, block_size,
    num_kv_heads, head_dim]; `slot_mapping`: int64 [num_tokens], block_id * block_size + offset.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        num_kv_heads, head_dim,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        BLOCK_SIZE=kv_cache.shape[2],
        HEADS=triton.next_power_of_2(num_kv_heads),
        DIM=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _rope_write_kv_cache_kernel(
    query_ptr, key_ptr, value_ptr, q_out_ptr, cache_ptr, slot_mapping_ptr, positions_ptr, cos_sin_ptr,
    num_heads, num_kv_heads, half_dim,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_c_dim,
    stride_cs,
    BLOCK_SIZE: tl.constexpr, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
):
    """One program per token: rotate its query heads into `q_out` and its key heads (NeoX halves,
    in float32, as kernels/rotary.py), then store the rotated key and the value in its slot.
    The query is rotated even for a padded token (slot -1), so `q_out` is always defined."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)
    dim_ok = dims < half_dim
    cos = tl.load(cos_sin_ptr + position * stride_cs + dims, mask=dim_ok)[None, :]
    sin = tl.load(cos_sin_ptr + position * stride_cs + half_dim + dims, mask=dim_ok)[None, :]

    q_heads = tl.arange(0, Q_HEADS)[:, None]
    q_mask = (q_heads < num_heads) & dim_ok[None, :]
    q1_ptr = query_ptr + token * stride_qt + q_heads * stride_qh + dims[None, :] * stride_qd
    q1 = tl.load(q1_ptr, mask=q_mask).to(tl.float32)
    q2 = tl.load(q1_ptr + half_dim * stride_qd, mask=q_mask).to(tl.float32)
    o1_ptr = q_out_ptr + token * stride_ot + q_heads * stride_oh + dims[None, :] * stride_od
    tl.store(o1_ptr, (q1 * cos - q2 * sin).to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(o1_ptr + half_dim * stride_od, (q2 * cos + q1 * sin).to(q_out_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    kv_heads = tl.arange(0, KV_HEADS)[:, None]
    kv_mask = (kv_heads < num_kv_heads) & dim_ok[None, :]
    k1_ptr = key_ptr + token * stride_kt + kv_heads * stride_kh + dims[None, :] * stride_kd
    k1 = tl.load(k1_ptr, mask=kv_mask).to(tl.float32)
    k2 = tl.load(k1_ptr + half_dim * stride_kd, mask=kv_mask).to(tl.float32)
    v_ptr = value_ptr + token * stride_vt + kv_heads * stride_vh + dims[None, :] * stride_vd
    v1 = tl.load(v_ptr, mask=kv_mask)
    v2 = tl.load(v_ptr + half_dim * stride_vd, mask=kv_mask)
    dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot
           + kv_heads * stride_c_head + dims[None, :] * stride_c_dim)
    tl.store(dst, (k1 * cos - k2 * sin).to(cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dst + half_dim * stride_c_dim, (k2 * cos + k1 * sin).to(cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dst + stride_c_kv, v1, mask=kv_mask)
    tl.store(dst + stride_c_kv + half_dim * stride_c_dim, v2, mask=kv_mask)


def rope_write_kv_cache(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> torch.Tensor:
    """The rotary embedding and the KV-cache write in one kernel: returns the rotated queries
    ([num_tokens, num_heads, head_dim], a new tensor) and stores the rotated keys and the values
    at their slots (a slot of -1 writes nothing). `query`/`key`/`value` may be strided views of
    the fused QKV projection's output; `cos_sin_cache` is float32 [max_position, head_dim]."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if head_dim % 2 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"rotary table width {cos_sin_cache.shape[-1]} must equal the even head_dim {head_dim}")
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    _rope_write_kv_cache_kernel[(num_tokens,)](
        query, key, value, q_out, kv_cache, slot_mapping, positions, cos_sin_cache,
        num_heads, num_kv_heads, head_dim // 2,
        *query.stride(), *key.stride(), *value.stride(), *q_out.stride(), *kv_cache.stride(),
        cos_sin_cache.stride(0),
        BLOCK_SIZE=kv_cache.shape[2],
        Q_HEADS=triton.next_power_of_2(num_heads),
        KV_HEADS=triton.next_power_of_2(num_kv_heads),
        HALF=triton.next_power_of_2(head_dim // 2),
    )
    return q_out


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request owning the program's query block; `num_reqs` means the padded tail.

    Request i owns the blocks from `query_start_loc[i] // BLOCK_Q + i` on: an upper bound on the
    blocks of the requests before it, found with a binary search instead of a host-side table.
    """
    lo: tl.int32 = 0
    hi = num_reqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The batch's counts change every step: were they specialised (Triton does so for a value of 1
# or a multiple of 16), a combination start-up never ran would compile a variant mid-serving.
@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
def _unified_attention_kernel(
    query_ptr, cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, num_tokens, num_reqs, head_dim,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_c_dim,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per (query block of a request, KV head), online softmax over the context.

    Its BLOCK_M rows are BLOCK_Q query tokens times the GROUP query heads sharing the KV head.
    Programs past the last request zero the padded tail tokens, so every output row is finite.
    """
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    is_real = req < num_reqs
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1, mask=is_real, other=num_tokens)
    seq_len = tl.load(seq_lens_ptr + req, mask=is_real, other=0)
    query_len = q_end - q_start
    context_len = seq_len - query_len
    first_q = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)
    q_offset = first_q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (q_offset < query_len)
    dims = tl.arange(0, DIM)
    dim_mask = dims < head_dim
    tokens = (q_start + q_offset).to(tl.int64)
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
        + dims[None, :] * stride_qd,
        mask=io_mask, other=0.0,
    )
    q_pos = context_len + q_offset
    # Keys at positions below kv_len are all any row of this block may see (causal).
    kv_len = tl.minimum(seq_len, context_len + first_q + BLOCK_Q)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    key_cache_ptr = cache_ptr + kv_head * stride_c_head
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    for tile_start in range(0, kv_len, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        pos_mask = pos < kv_len
        block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0)
        slot_offset = block.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot
        k = tl.load(
            key_cache_ptr + slot_offset[None, :] + dims[:, None] * stride_c_dim,
            mask=pos_mask[None, :] & dim_mask[:, None], other=0.0,
        )
        v = tl.load(
            key_cache_ptr + stride_c_kv + slot_offset[:, None] + dims[None, :] * stride_c_dim,
            mask=pos_mask[:, None] & dim_mask[None, :], other=0.0,
        )
        s = tl.dot(q, k) * scale_log2
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_mask[None, :], s, float("-inf"))
        # Every row that is stored sees key 0 in the first tile: its m_new is finite from then on.
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
        + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty), mask=io_mask,
    )


def unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of a whole mixed batch (decodes, prefills, cached prefixes) in one launch.

    `query`: [num_tokens, num_heads, head_dim], possibly padded past the batch's real tokens (those
    rows come back as zeros); keys and values are read only from `kv_cache`, where
    `write_kv_cache` put them. Returns [num_tokens, num_heads, head_dim] in query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if output is None:
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return output
    group = num_heads // num_kv_heads
    num_reqs = metadata.num_reqs
    # Chosen from shapes only, which a CUDA graph fixes, never from per-step values.
    prefill_heavy = num_tokens >= _PREFILL_MIN_AVG_QUERY * num_reqs
    block_m = max(_PREFILL_ROWS if prefill_heavy else _DECODE_ROWS, triton.next_power_of_2(group))
    block_q = block_m // group
    # Enough query blocks for every request's tokens plus the padded tail (see _find_request).
    grid = (num_tokens // block_q + num_reqs + 1, num_kv_heads)
    _unified_attention_kernel[grid](
        query, kv_cache, output, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
        scale * _LOG2_E, num_tokens, num_reqs, head_dim,
        *query.stride(), *output.stride(),
        *kv_cache.stride(),
        metadata.block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=_TILE_N,
        DIM=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_cache.shape[2],
    )
    return output
