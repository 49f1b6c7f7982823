"""The C++ CPU kernels (KV write, decode and prefill attention) against the torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.kernels.cpu_attention import attention, paged_attention, write_kv_cache
from compiled_llm.kernels.cpu_extension import cpu_kernels_available
from compiled_llm.kernels.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built")


def make_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(query_lens)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = num_reqs * max_blocks + 8
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # scattered blocks, never the null block
    tables = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    slots, next_block = [], 0
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        n = -(-s // block_size)
        tables[r, :n] = perm[next_block : next_block + n]
        next_block += n
        for pos in range(s - q, s):
            slots.append(int(tables[r, pos // block_size]) * block_size + pos % block_size)
    total = sum(query_lens)
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    meta = AttentionMetadata(
        num_actual_tokens=total, num_reqs=num_reqs, num_decodes=sum(1 for q in query_lens if q == 1),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=starts, seq_lens_cpu=np.array(seq_lens),
    )
    # Keys and values as views of one fused projection, like the model's.
    qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.reshape(total, num_heads, head_dim).contiguous(), k.view(total, num_kv_heads, head_dim),
            v.view(total, num_kv_heads, head_dim), kv_cache, meta)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
def test_decode_batch_matches_reference(block_size, heads):
    num_heads, num_kv_heads = heads
    q, k, v, cache, meta = make_batch([1] * 5, [0, 3, 17, 40, 130], num_heads, num_kv_heads, 64, block_size)
    ref_cache = cache.clone()
    write_kv_cache(k, v, ref_cache, meta.slot_mapping, reference=True)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    ref = paged_attention(q, k, v, ref_cache, meta, 0.125, reference=True)
    got = paged_attention(q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_mixed_batch_and_head_dim_32():
    q, k, v, cache, meta = make_batch([1, 1, 7, 20], [9, 50, 0, 33], 6, 2, 32, 16)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    ref = paged_attention(q, k, v, cache, meta, 0.2, reference=True)
    got = paged_attention(q, k, v, cache, meta, 0.2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_padded_slots_write_nothing():
    q, k, v, cache, meta = make_batch([1, 1], [4, 4], 4, 2, 64, 16)
    before = cache.clone()
    write_kv_cache(k, v, cache, torch.tensor([-1, -1]))
    assert torch.equal(cache, before)


def test_long_context_softmax_is_stable():
    q, k, v, cache, meta = make_batch([1], [3000], 9, 3, 64, 16)
    q *= 30  # large scores: the kernel must subtract the max before exponentiating
    write_kv_cache(k, v, cache, meta.slot_mapping)
    ref = paged_attention(q, k, v, cache, meta, 0.125, reference=True)
    got = paged_attention(q, k, v, cache, meta, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 90)), min_size=1, max_size=5),
    heads=st.sampled_from([(4, 4), (9, 3), (8, 1), (6, 2)]),
    head_dim=st.sampled_from([64, 32, 128, 24]),
    block_size=st.sampled_from([8, 16, 32]),
    vector_width=st.sampled_from([8, 16]),  # AVX2's and AVX-512's, both run on any CPU
    threads=st.sampled_from([1, 2]),
)
def test_prefill_kernel_matches_reference(requests, heads, head_dim, block_size, vector_width, threads):
    """Ragged batches: decodes first, then prompts with and without cached context (chunked
    prefill, prefix-cache hits), every GQA grouping and both vector widths."""
    requests = sorted(requests, key=lambda r: r[0] != 1)
    query_lens, context_lens = [q for q, _ in requests], [c for _, c in requests]
    q, k, v, cache, meta = make_batch(query_lens, context_lens, *heads, head_dim, block_size)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    ref = paged_attention(q, k, v, cache, meta, 0.3, reference=True)
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.ops.compiled_llm_cpu.paged_prefill_attention(
            out, q, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
            0.3, vector_width,
        )
    finally:
        torch.set_num_threads(before)
    first = int(meta.query_start_loc[meta.num_decodes])
    assert torch.isnan(out[:first]).all()  # decode rows are left to the decode kernel
    torch.testing.assert_close(out[first:], ref[first:], rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    contexts=st.lists(st.integers(0, 700), min_size=1, max_size=3),
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1), (6, 2)]),
    head_dim=st.sampled_from([64, 32, 128, 24]),
    block_size=st.sampled_from([8, 16, 32]),
    threads=st.sampled_from([1, 2, 3, 4]),
    step=st.booleans(),
)
def test_few_decodes_split_over_threads_match_reference(contexts, heads, head_dim, block_size, threads, step):
    """Batches of 1-3 decodes, whose contexts the decode kernel cuts into position ranges spread
    over the threads (merged after), through the decode op and through the one-call step."""
    q, k, v, cache, meta = make_batch([1] * len(contexts), contexts, *heads, head_dim, block_size)
    q *= 10  # the parts' maxima differ: the merge must rescale them
    ref_cache = cache.clone()
    write_kv_cache(k, v, ref_cache, meta.slot_mapping, reference=True)
    # In float64: with scores this large the float32 reference errs by up to 1.3e-5 itself (the
    # kernel by 3e-6), more than the tolerance.
    ref = paged_attention(q.double(), k.double(), v.double(), ref_cache.double(), meta, 0.125, reference=True)
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if step:
            attention(q, k, v, out, cache, meta, 0.125)
        else:
            write_kv_cache(k, v, cache, meta.slot_mapping)
            torch.ops.compiled_llm_cpu.paged_decode_attention(out, q, cache[0], cache[1], meta.block_tables,
                                                              meta.seq_lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)



@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.one_of(st.just(1), st.integers(2, 16), st.integers(17, 40)), st.integers(0, 700)),
        min_size=1, max_size=4,
    ),
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1), (6, 2)]),
    head_dim=st.sampled_from([64, 32, 128, 24]),
    block_size=st.sampled_from([8, 16, 32]),
    threads=st.sampled_from([1, 2, 3, 4]),
    rotary=st.booleans(),
)
def test_short_queries_take_the_decode_kernel_and_match_reference(requests, heads, head_dim, block_size, threads,
                                                                   rotary):
    """Speculative verifications (2-16 query tokens) and tiny prefill chunks, in any order among
    decodes and long prefills, go through the multi-query decode kernel (its contexts split over
    the threads, causal per query token) and equal the torch reference."""
    from compiled_llm.kernels.rotary import rotary_embedding
    from compiled_llm.models.layers.rotary import RotaryEmbedding

    query_lens = [q for q, _ in requests]
    q, k, v, cache, meta = make_batch(query_lens, [c for _, c in requests], *heads, head_dim, block_size)
    meta.num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))  # the leading ones
    q *= 10  # the parts' maxima differ: the merge must rescale them
    positions = table = None
    ref_q, ref_k = q, k
    if rotary:
        table = RotaryEmbedding(head_dim, 1024, 10000.0).cos_sin_cache
        positions = torch.randint(0, 1024, (q.shape[0],), generator=torch.Generator().manual_seed(len(requests)))
        ref_q, ref_k = rotary_embedding(positions, q, k, table)
    ref_cache = cache.clone()
    write_kv_cache(ref_k, v, ref_cache, meta.slot_mapping, reference=True)
    # In float64: with scores this large float32 rounding alone (the reference's, the prefill
    # kernel's) reaches 1-2e-5; a wrong causal limit or merge is off by far more.
    ref = paged_attention(ref_q.double(), ref_k.double(), v.double(), ref_cache.double(), meta, 0.125,
                          reference=True).float()
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        attention(q, k, v, out, cache, meta, 0.125, positions, table)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref, rtol=5e-5, atol=5e-5)


def test_short_query_longer_than_its_context_is_rejected():
    q, k, v, cache, meta = make_batch([1, 5], [4, 3], 4, 2, 64, 16)
    meta.seq_lens[1] = 4  # 5 query tokens cannot fit in a context of 4
    with pytest.raises(RuntimeError, match="more query tokens than its seq_len"):
        attention(q, k, v, torch.empty_like(q), cache, meta, 0.1)

def test_prefill_through_paged_attention_and_long_prompt():
    q, k, v, cache, meta = make_batch([1, 300, 45], [20, 0, 500], 9, 3, 64, 16)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    q *= 20  # large scores: the online softmax must rescale what it summed before
    ref = paged_attention(q, k, v, cache, meta, 0.125, reference=True)
    got = paged_attention(q, k, v, cache, meta, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_prefill_kernel_rejects_bad_layouts():
    q, k, v, cache, meta = make_batch([5], [0], 4, 2, 64, 16)
    out = torch.empty_like(q)
    args = (cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, 0.1)
    with pytest.raises(RuntimeError, match="query must be float32"):
        torch.ops.compiled_llm_cpu.paged_prefill_attention(out, q.double(), *args)
    with pytest.raises(RuntimeError, match="must be int32"):
        torch.ops.compiled_llm_cpu.paged_prefill_attention(
            out, q, cache[0], cache[1], meta.block_tables.long(), meta.seq_lens, meta.query_start_loc, 0, 0.1
        )
    with pytest.raises(RuntimeError, match="vector_width must be 0, 8 or 16"):
        torch.ops.compiled_llm_cpu.paged_prefill_attention(out, q, *args, 4)


@settings(max_examples=30, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=5),
    heads=st.sampled_from([(4, 4), (9, 3), (8, 1)]),
    head_dim=st.sampled_from([64, 32, 24]),
    block_size=st.sampled_from([8, 16]),
    padding=st.integers(0, 3),
)
def test_attention_step_matches_reference(requests, heads, head_dim, block_size, padding):
    """The one-call layer attention (KV write, decode, prefill, zeroed padding) equals the torch
    reference's write and attention, on ragged batches with padded rows (slot -1) at the end."""
    requests = sorted(requests, key=lambda r: r[0] != 1)
    q, k, v, cache, meta = make_batch([r[0] for r in requests], [r[1] for r in requests], *heads, head_dim,
                                      block_size)
    if padding:  # rows past num_actual_tokens, as a padded step has: written nowhere, output zero
        q, k, v = (torch.cat([t, torch.randn(padding, *t.shape[1:])]) for t in (q, k, v))
        meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((padding,), -1, dtype=torch.int64)])
    ref_cache = cache.clone()
    write_kv_cache(k, v, ref_cache, meta.slot_mapping, reference=True)
    ref = paged_attention(q, k, v, ref_cache, meta, 0.3, reference=True)
    out = torch.full_like(q, float("nan"))
    attention(q, k, v, out, cache, meta, 0.3)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if padding:
        assert torch.equal(out[-padding:], torch.zeros_like(out[-padding:]))


@settings(max_examples=25, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 40)), min_size=1, max_size=4),
    heads=st.sampled_from([(4, 4), (9, 3), (8, 1)]),
    head_dim=st.sampled_from([64, 32, 24]),
    padding=st.integers(0, 2),
    strided_query=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_attention_step_with_rotary_matches_rotary_then_attention(requests, heads, head_dim, padding,
                                                                   strided_query, seed):
    """What the rotary fusion pass produces (the op rotating its unrotated, strided inputs itself)
    equals the unfused sequence: the reference rotary, then the op."""
    from compiled_llm.kernels.rotary import rotary_embedding
    from compiled_llm.models.layers.rotary import RotaryEmbedding

    requests = sorted(requests, key=lambda r: r[0] != 1)
    q, k, v, cache, meta = make_batch([r[0] for r in requests], [r[1] for r in requests], *heads, head_dim, 16,
                                      seed=seed)
    if padding:
        q, k, v = (torch.cat([t, torch.randn(padding, *t.shape[1:])]) for t in (q, k, v))
        meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((padding,), -1, dtype=torch.int64)])
    if strided_query:  # as a view of the fused QKV output
        q = torch.cat([q, torch.randn(q.shape[0], 2, head_dim)], dim=1)[:, : heads[0]]
    table = RotaryEmbedding(head_dim, 512, 10000.0).cos_sin_cache
    positions = torch.randint(0, 512, (q.shape[0],), generator=torch.Generator().manual_seed(seed))
    ref_cache, ref_out = cache.clone(), torch.full_like(q, float("nan")).contiguous()
    attention(*rotary_embedding(positions, q, k, table), v, ref_out, ref_cache, meta, 0.3)
    out = torch.full_like(ref_out, float("nan"))
    attention(q, k, v, out, cache, meta, 0.3, positions, table)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_attention_qkv_splits_the_fused_output_as_the_model_does(heads):
    """The `attention.qkv` path (split and rotary in C++) equals the reference rotary and attention
    over the model's own split of the same QKV output."""
    from compiled_llm.kernels.cpu_attention import attention_qkv
    from compiled_llm.kernels.rotary import rotary_embedding
    from compiled_llm.models.layers.rotary import RotaryEmbedding

    num_heads, num_kv_heads = heads
    _, _, _, cache, meta = make_batch([1, 1, 6, 9], [30, 0, 17, 0], num_heads, num_kv_heads, 64, 16)
    qkv = torch.randn(meta.num_actual_tokens, (num_heads + 2 * num_kv_heads) * 64)
    q, k, v = (t.view(qkv.shape[0], -1, 64) for t in qkv.split([num_heads * 64, num_kv_heads * 64,
                                                                 num_kv_heads * 64], dim=-1))
    table = RotaryEmbedding(64, 256, 10000.0).cos_sin_cache
    positions = torch.randint(0, 256, (qkv.shape[0],))
    ref_cache, ref_out = cache.clone(), torch.empty(qkv.shape[0], num_heads, 64)
    rotated_q, rotated_k = rotary_embedding(positions, q, k, table)
    write_kv_cache(rotated_k, v, ref_cache, meta.slot_mapping, reference=True)
    paged_attention(rotated_q, rotated_k, v, ref_cache, meta, 0.2, output=ref_out, reference=True)
    out = torch.full_like(ref_out, float("nan"))
    attention_qkv(qkv, out, cache, meta, 0.2, num_kv_heads, positions, table)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="qkv must be"):
        attention_qkv(qkv[:, :-64], out, cache, meta, 0.2, num_kv_heads, positions, table)


def test_attention_step_rejects_bad_rotary_arguments():
    q, k, v, cache, meta = make_batch([1, 3], [4, 0], 4, 2, 64, 16)
    args = (meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, 2, 1, 4, 0.1)
    table = torch.zeros(8, 64)
    with pytest.raises(RuntimeError, match="go together"):
        torch.ops.compiled_llm_cpu.attention_step(q, k, v, torch.empty_like(q), cache, *args, torch.zeros(4).long())
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        torch.ops.compiled_llm_cpu.attention_step(q, k, v, torch.empty_like(q), cache, *args,
                                                  torch.tensor([0, 1, 8, 2]), table)
    with pytest.raises(RuntimeError, match="cos_sin_cache must be"):
        torch.ops.compiled_llm_cpu.attention_step(q, k, v, torch.empty_like(q), cache, *args,
                                                  torch.zeros(4).long(), torch.zeros(8, 32))


def test_attention_step_rejects_bad_arguments():
    q, k, v, cache, meta = make_batch([1, 3], [4, 0], 4, 2, 64, 16)
    args = (meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    with pytest.raises(RuntimeError, match="num_decodes <= num_reqs"):
        torch.ops.compiled_llm_cpu.attention_step(q, k, v, torch.empty_like(q), cache, *args, 2, 3, 4, 0.1)
    with pytest.raises(RuntimeError, match="kv_cache must be float32"):
        torch.ops.compiled_llm_cpu.attention_step(q, k, v, torch.empty_like(q), cache[0], *args, 2, 1, 4, 0.1)
