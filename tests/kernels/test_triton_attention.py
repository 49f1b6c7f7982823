"""The Triton kernels against the torch reference: interpreted on the CPU, compiled on a GPU.

The CPU cases run in one subprocess with TRITON_INTERPRET=1 (this file is its script), so the
interpreter never leaks into other tests, which must see compiled kernels on a GPU. The
interpreter cannot `tl.dot` bfloat16 (triton-lang/triton#11584), so bfloat16 attention is
checked on the GPU only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from compiled_llm.kernels import cpu_attention, triton_attention  # noqa: E402
from compiled_llm.kernels.metadata import AttentionMetadata  # noqa: E402


@dataclass(frozen=True)
class Batch:
    """A mixed batch: (context_len, query_len) per request, decodes first, plus padding."""

    name: str
    requests: tuple[tuple[int, int], ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    pad_tokens: int = 0  # rows past the last request (piecewise-graph padding)
    pad_reqs: int = 0  # requests of one query token and seq_len 0 (full-graph decode padding)
    tolerance: float = 1e-4


DECODES = ((0, 1), (15, 1), (16, 1), (40, 1), (150, 1))
PREFIX = ((37, 11), (16, 20), (90, 5))
CPU_BATCHES = [
    Batch("decode-gqa1-d64", DECODES, 4, 4, 64),
    Batch("decode-gqa3-d32", DECODES, 6, 2, 32),
    Batch("prefill-gqa3-d64", ((0, 7), (0, 19), (0, 70)), 6, 2, 64),
    Batch("prefill-gqa1-d32", ((0, 33), (0, 2)), 2, 2, 32),
    Batch("prefix-gqa1-d32-block16", PREFIX, 2, 2, 32),
    Batch("prefix-gqa3-d64-block8", PREFIX, 3, 1, 64, block_size=8),
    Batch("prefix-gqa3-d32-block32", PREFIX, 6, 2, 32, block_size=32),
    Batch("mixed-gqa3-d64-padded", ((10, 1), (70, 1), (0, 13), (45, 30)), 6, 2, 64, pad_tokens=5),
    Batch("mixed-decode-heavy-gqa3-d32", ((3, 1),) * 6 + ((40, 12),), 6, 2, 32, pad_tokens=2),
    Batch("decode-padded-requests-gqa3-d32", ((20, 1), (33, 1), (0, 1)), 6, 2, 32, pad_reqs=3),
    Batch("mixed-gqa3-d48-unaligned-dim", ((9, 1), (20, 9)), 6, 2, 48),
    Batch("mixed-gqa3-d64-fp16", ((10, 1), (70, 1), (45, 30)), 6, 2, 64,
          dtype=torch.float16, pad_tokens=3, tolerance=2e-3),
]

WRITE_CASES = {"write-fp32": torch.float32, "write-fp16": torch.float16, "write-bf16": torch.bfloat16}


def _make_batch(batch: Batch, device: str, seed: int = 0):
    """Random query/key/value and a cache holding each request's context; unused slots are NaN.

    Returns (query, key, value, kv_cache, metadata, num_real_tokens, num_real_reqs).
    """
    gen = torch.Generator().manual_seed(seed)
    dtype = batch.dtype
    real_reqs = len(batch.requests)
    num_reqs = real_reqs + batch.pad_reqs
    seq_lens = [c + q for c, q in batch.requests] + [0] * batch.pad_reqs
    query_lens = [q for _, q in batch.requests] + [1] * batch.pad_reqs
    num_real_tokens = sum(q for _, q in batch.requests)
    num_tokens = sum(query_lens) + batch.pad_tokens
    bs = batch.block_size
    blocks_per_req = [-(-s // bs) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 4
    # Scattered, distinct physical blocks; the null block 0 pads the tables.
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        del ids[:n]

    def slot(i: int, pos: int) -> int:
        return int(block_tables[i, pos // bs]) * bs + pos % bs

    shape = (num_blocks, bs, batch.num_kv_heads, batch.head_dim)
    kv_cache = torch.full((2, *shape), float("nan"), dtype=dtype)
    context_slots = [slot(i, p) for i, (c, _) in enumerate(batch.requests) for p in range(c)]
    if context_slots:
        n = len(context_slots)
        kv = torch.randn(2, n, batch.num_kv_heads, batch.head_dim, generator=gen).to(dtype)
        cpu_attention.write_kv_cache(kv[0], kv[1], kv_cache, torch.tensor(context_slots))
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
    slot_mapping[:num_real_tokens] = torch.tensor(
        [slot(i, c + j) for i, (c, q) in enumerate(batch.requests) for j in range(q)]
    )
    query = torch.randn(num_tokens, batch.num_heads, batch.head_dim, generator=gen).to(dtype)
    key, value = torch.randn(2, num_tokens, batch.num_kv_heads, batch.head_dim, generator=gen).to(dtype)
    cpu_attention.write_kv_cache(key, value, kv_cache, slot_mapping)

    query_start_loc = np.cumsum([0] + query_lens).astype(np.int32)
    seq_lens_np = np.array(seq_lens, dtype=np.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_real_tokens,
        num_reqs=num_reqs,
        num_decodes=_leading_decodes(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens_np).to(device),
        block_tables=block_tables.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_np,
    )
    query, key, value, kv_cache = (t.to(device) for t in (query, key, value, kv_cache))
    return query, key, value, kv_cache, metadata, num_real_tokens, real_reqs


def _leading_decodes(query_lens) -> int:
    """How many requests at the front have one query token (the reference's decode batch)."""
    return next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))


def _reference(query, key, value, kv_cache, metadata, num_real_tokens, real_reqs, scale):
    """The torch reference in float32 over the real requests only (it knows no padding)."""
    starts = metadata.query_start_loc_cpu[: real_reqs + 1]
    seq_lens = metadata.seq_lens_cpu[:real_reqs]
    ref_metadata = AttentionMetadata(
        num_actual_tokens=num_real_tokens,
        num_reqs=real_reqs,
        num_decodes=_leading_decodes(np.diff(starts)),
        max_query_len=int(np.diff(starts).max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.from_numpy(starts),
        seq_lens=torch.from_numpy(seq_lens),
        block_tables=metadata.block_tables[:real_reqs].cpu(),
        slot_mapping=metadata.slot_mapping[:num_real_tokens].cpu(),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    f32 = lambda t: t[:num_real_tokens].cpu().float()  # noqa: E731
    cache = torch.nan_to_num(kv_cache.cpu().float())  # SDPA would spread masked NaNs
    return cpu_attention.paged_attention(f32(query), f32(key), f32(value), cache, ref_metadata, scale)


def check_attention(batch: Batch, device: str, seed: int = 0) -> None:
    """unified_attention matches the reference on real rows and writes zeros on padded ones."""
    query, key, value, kv_cache, metadata, num_real, real_reqs = _make_batch(batch, device, seed)
    scale = batch.head_dim**-0.5
    output = torch.full_like(query, float("nan"))
    out = triton_attention.unified_attention(query, kv_cache, metadata, scale, output=output)
    assert out is output and out.dtype == batch.dtype
    expected = _reference(query, key, value, kv_cache, metadata, num_real, real_reqs, scale)
    torch.testing.assert_close(
        out[:num_real].cpu().float(), expected, atol=batch.tolerance, rtol=batch.tolerance
    )
    assert torch.equal(out[num_real:].cpu(), torch.zeros_like(out[num_real:].cpu()))


def check_write(dtype: torch.dtype, device: str, num_tokens: int = 37, block_size: int = 16) -> None:
    """The Triton KV write equals the torch one, skips -1 slots, and reads strided keys."""
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim = 3, 64
    num_blocks = max(8, -(-num_tokens // block_size) + 1)  # room for every token's slot
    # Keys and values as views of one fused projection output, as the model produces them.
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected = cache.clone()
    cpu_attention.write_kv_cache(key.cpu(), value.cpu(), expected, slots)
    cache = cache.to(device)
    triton_attention.write_kv_cache(key, value, cache, slots.to(device))
    assert torch.equal(cache.cpu(), expected)


ROPE_WRITE_CASES = {"rope-write-fp32": torch.float32, "rope-write-fp16": torch.float16,
                    "rope-write-bf16": torch.bfloat16}


def check_rope_write(dtype: torch.dtype, device: str, num_tokens: int = 29, block_size: int = 16) -> None:
    """The fused rotary + KV write equals the reference rotary followed by the reference write:
    queries, keys and values read as strided views of one QKV output, -1 slots skipped, the
    rotated queries returned for every row (padded ones included)."""
    from compiled_llm.kernels.rotary import rotary_embedding
    from compiled_llm.models.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    table = RotaryEmbedding(head_dim, 4096, 100000.0).cos_sin_cache
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    num_blocks = -(-num_tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected_cache = cache.clone()
    rotated_q, rotated_k = rotary_embedding(positions, query, key, table)
    cpu_attention.write_kv_cache(rotated_k, value, expected_cache, slots, reference=True)
    cache = cache.to(device)
    q_out = triton_attention.rope_write_kv_cache(
        query.to(device), key.to(device), value.to(device), cache, slots.to(device), positions.to(device),
        table.to(device),
    )
    tolerance = {torch.float32: 1e-5}.get(dtype, 1e-2)  # one rounding of a float32 result either way
    torch.testing.assert_close(q_out.cpu(), rotated_q, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(cache.cpu(), expected_cache, atol=tolerance, rtol=tolerance)
    untouched = torch.ones(2, num_blocks * block_size, dtype=torch.bool)
    untouched[:, slots[slots >= 0]] = False
    flat = lambda c: c.view(2, num_blocks * block_size, -1)  # noqa: E731
    assert torch.equal(flat(cache.cpu())[untouched], flat(expected_cache)[untouched])


def check_fused_attention_op(batch: Batch, device: str) -> None:
    """The GPU implementation of the op the rotary fusion pass calls (`attention.qkv`: split, rotary
    and KV write in one Triton kernel, then attention) equals the unfused sequence through the torch
    reference: the model's split, the reference rotary, the reference write and attention."""
    from compiled_llm.compilation.forward_context import set_forward_context
    from compiled_llm.kernels.rotary import rotary_embedding
    from compiled_llm.models.layers.attention import _attention_qkv_cuda
    from compiled_llm.models.layers.rotary import RotaryEmbedding

    query, key, value, kv_cache, metadata, num_real, real_reqs = _make_batch(batch, device)
    qkv = torch.cat([t.flatten(1) for t in (query, key, value)], dim=1)  # what the QKV projection returns
    table = RotaryEmbedding(batch.head_dim, 4096, 10000.0).cos_sin_cache.to(device)
    positions = torch.randint(0, 4096, (qkv.shape[0],), generator=torch.Generator().manual_seed(3)).to(device)
    scale = batch.head_dim**-0.5
    expected_cache = kv_cache.cpu().clone()
    output = torch.full_like(query, float("nan"))
    with set_forward_context(metadata):
        _attention_qkv_cuda(qkv, output, kv_cache, scale, batch.num_kv_heads, positions, table)
    rotated_q, rotated_k = rotary_embedding(positions.cpu(), query.cpu(), key.cpu(), table.cpu())
    cpu_attention.write_kv_cache(rotated_k, value.cpu(), expected_cache, metadata.slot_mapping.cpu(), reference=True)
    f32 = lambda t: t.cpu().float()  # noqa: E731
    torch.testing.assert_close(f32(kv_cache).nan_to_num(), f32(expected_cache).nan_to_num(),
                               atol=batch.tolerance, rtol=batch.tolerance)
    expected = _reference(rotated_q, rotated_k, value, kv_cache, metadata, num_real, real_reqs, scale)
    torch.testing.assert_close(f32(output[:num_real]), expected, atol=batch.tolerance, rtol=batch.tolerance)


FUSED_CASES = {f"fused-op-{b.name}": b for b in CPU_BATCHES if b.name in ("mixed-gqa3-d64-padded",
                                                                              "decode-gqa3-d32")}


def _run_interpreted_cases() -> dict[str, str | None]:
    """Every CPU case in this process (TRITON_INTERPRET=1): its traceback, or None if it passed."""
    cases = {b.name: (check_attention, b) for b in CPU_BATCHES}
    cases |= {name: (check_write, dtype) for name, dtype in WRITE_CASES.items()}
    cases |= {name: (check_rope_write, dtype) for name, dtype in ROPE_WRITE_CASES.items()}
    cases |= {name: (check_fused_attention_op, b) for name, b in FUSED_CASES.items()}
    results: dict[str, str | None] = {}
    for name, (check, arg) in cases.items():
        try:
            check(arg, "cpu")
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str | None]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [b.name for b in CPU_BATCHES] + list(WRITE_CASES) + list(ROPE_WRITE_CASES)
                         + list(FUSED_CASES))
def test_interpreted_kernel_matches_reference(interpreted_results, name):
    assert name in interpreted_results, f"case {name} did not run"
    assert interpreted_results[name] is None, interpreted_results[name]


def gpu_batch(name: str, requests, num_heads: int, num_kv_heads: int, head_dim: int, **kwargs) -> Batch:
    """A GPU case: bfloat16 unless told otherwise, compared at half-precision tolerance."""
    kwargs.setdefault("dtype", torch.bfloat16)
    return Batch(name, tuple(requests), num_heads, num_kv_heads, head_dim, tolerance=2e-2, **kwargs)


# SmolLM2-135M: 9 heads, 3 KV heads, head_dim 64. Llama-8B-like: 32 heads, 8 KV heads, head_dim 128.
LONG_DECODES = tuple((int(c), 1) for c in np.random.default_rng(0).integers(0, 2048, size=64))
GPU_BATCHES = [
    gpu_batch("decode-smollm2", LONG_DECODES, 9, 3, 64),
    gpu_batch("prefill-smollm2", ((0, 1), (0, 512), (0, 77)), 9, 3, 64),
    gpu_batch("prefix-smollm2-block32", ((1000, 300), (2000, 48), (16, 700)), 9, 3, 64, block_size=32),
    gpu_batch("mixed-smollm2-padded", LONG_DECODES[:32] + ((0, 257), (1500, 200)), 9, 3, 64,
              pad_tokens=7),
    gpu_batch("decode-padded-requests-smollm2", LONG_DECODES[:5], 9, 3, 64, pad_reqs=3),
    gpu_batch("mixed-gqa1-d128", LONG_DECODES[:8] + ((300, 100),), 8, 8, 128),
    gpu_batch("mixed-gqa4-d128-fp16", LONG_DECODES[:8] + ((300, 100),), 32, 8, 128,
              dtype=torch.float16),
]


@pytest.mark.cuda
@pytest.mark.parametrize("batch", GPU_BATCHES, ids=lambda b: b.name)
def test_gpu_attention_matches_reference(batch):
    check_attention(batch, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_write_kv_cache_matches_reference(dtype):
    check_write(dtype, "cuda", num_tokens=1000, block_size=16)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_rope_write_kv_cache_matches_reference(dtype):
    check_rope_write(dtype, "cuda", num_tokens=1000)


@pytest.mark.cuda
@pytest.mark.parametrize("batch", GPU_BATCHES[:4], ids=lambda b: b.name)
def test_gpu_fused_attention_op_matches_reference(batch):
    check_fused_attention_op(batch, "cuda")


@pytest.mark.cuda
def test_gpu_kernels_replay_in_a_cuda_graph():
    """Captured once, the write and the attention follow new buffer contents on every replay."""
    # The same requests in another order: new contents, same shapes.
    first = gpu_batch("graph", LONG_DECODES[:16] + ((40, 30),), 9, 3, 64, pad_tokens=3)
    second = gpu_batch("graph", LONG_DECODES[:16][::-1] + ((40, 30),), 9, 3, 64, pad_tokens=3)
    query, key, value, kv_cache, metadata, num_real, real_reqs = _make_batch(first, "cuda")
    scale = 0.125

    def step() -> torch.Tensor:
        triton_attention.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return triton_attention.unified_attention(query, kv_cache, metadata, scale)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    q2, k2, v2, cache2, md2, _, _ = _make_batch(second, "cuda", seed=1)
    pairs = [(query, q2), (key, k2), (value, v2), (kv_cache, cache2)] + [
        (getattr(metadata, n), getattr(md2, n))
        for n in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")
    ]
    for dst, src in pairs:
        dst.copy_(src)
    # Only the captured write may put the new tokens' keys and values into the cache.
    new_slots = md2.slot_mapping[:num_real]
    kv_cache.view(2, -1, *kv_cache.shape[3:])[:, new_slots] = float("nan")
    graph.replay()
    torch.cuda.synchronize()
    expected = _reference(q2, k2, v2, cache2, md2, num_real, real_reqs, scale)
    torch.testing.assert_close(out[:num_real].cpu().float(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[num_real:].cpu(), torch.zeros_like(out[num_real:].cpu()))


if __name__ == "__main__":
    print(json.dumps(_run_interpreted_cases()))
