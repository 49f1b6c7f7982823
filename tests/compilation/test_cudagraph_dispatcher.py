"""The dispatcher decides which graph (if any) serves a step; these pin its rules for every mode."""

from __future__ import annotations

import pytest

from compiled_llm.compilation import BatchDescriptor, CudagraphDispatcher, CUDAGraphMode

M = CUDAGraphMode
SIZES = [1, 2, 4, 8, 16]


def make(mode: CUDAGraphMode, max_num_seqs: int = 16, q: int = 1, sizes=SIZES) -> CudagraphDispatcher:
    return CudagraphDispatcher(sizes, mode, max_num_seqs, uniform_query_lens=(q,))


def U(num_tokens: int, num_reqs: int, q: int = 1) -> BatchDescriptor:
    """A uniform batch's key: num_reqs requests of q query tokens each."""
    return BatchDescriptor(num_tokens, num_reqs, True, q)


def test_batch_descriptor_is_frozen_hashable_and_compared_by_value():
    d = BatchDescriptor(8, 8, True)
    assert d == BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True)
    assert hash(d) == hash(BatchDescriptor(8, 8, True))
    assert BatchDescriptor(8) == BatchDescriptor(8, None, False)
    assert BatchDescriptor(8) != d
    assert len({d, BatchDescriptor(8, 8, True), BatchDescriptor(8)}) == 2
    with pytest.raises(AttributeError):
        d.num_tokens = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        d[0] = 4  # type: ignore[index]


@pytest.mark.parametrize("uniform", [False, True])
def test_none_mode_is_always_eager_and_unpadded(uniform):
    d = make(M.NONE)
    assert d.keys == {M.FULL: set(), M.PIECEWISE: set()}
    assert d.capture_descriptors() == []
    for n in (1, 3, 16, 17):
        assert d.dispatch(n, uniform) == (M.NONE, BatchDescriptor(n))


@pytest.mark.parametrize("uniform", [False, True])
def test_piecewise_pads_to_the_smallest_capture_size_for_every_batch_kind(uniform):
    d = make(M.PIECEWISE)
    assert d.keys[M.PIECEWISE] == {BatchDescriptor(s) for s in SIZES}
    assert d.keys[M.FULL] == set()
    for n, padded in [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (16, 16)]:
        assert d.dispatch(n, uniform) == (M.PIECEWISE, BatchDescriptor(padded))
    assert d.dispatch(17, uniform) == (M.NONE, BatchDescriptor(17))
    assert d.dispatch(1000, uniform) == (M.NONE, BatchDescriptor(1000))


def test_full_and_piecewise_splits_uniform_decode_from_mixed():
    d = make(M.FULL_AND_PIECEWISE)
    assert d.keys[M.FULL] == {U(s, s) for s in SIZES}
    assert d.keys[M.PIECEWISE] == {BatchDescriptor(s) for s in SIZES}
    assert d.dispatch(3, uniform_decode=True) == (M.FULL, U(4, 4))
    assert d.dispatch(8, uniform_decode=True) == (M.FULL, U(8, 8))
    assert d.dispatch(3, uniform_decode=False) == (M.PIECEWISE, BatchDescriptor(4))
    assert d.dispatch(16, uniform_decode=False) == (M.PIECEWISE, BatchDescriptor(16))
    assert d.dispatch(17, uniform_decode=True) == (M.NONE, BatchDescriptor(17))
    assert d.dispatch(17, uniform_decode=False) == (M.NONE, BatchDescriptor(17))


def test_full_decode_only_runs_mixed_batches_eagerly():
    d = make(M.FULL_DECODE_ONLY)
    assert d.keys[M.PIECEWISE] == set()
    assert d.dispatch(5, uniform_decode=True) == (M.FULL, U(8, 8))
    assert d.dispatch(5, uniform_decode=False) == (M.NONE, BatchDescriptor(5))
    assert d.dispatch(17, uniform_decode=True) == (M.NONE, BatchDescriptor(17))


def test_plain_full_runs_mixed_batches_eagerly():
    # Full graphs serve uniform decode only: a mixed batch has no piecewise graph to fall to.
    d = make(M.FULL)
    assert d.keys[M.FULL] == {U(s, s) for s in SIZES}
    assert d.keys[M.PIECEWISE] == set()
    assert d.dispatch(3, uniform_decode=True) == (M.FULL, U(4, 4))
    assert d.dispatch(3, uniform_decode=False) == (M.NONE, BatchDescriptor(3))
    assert d.dispatch(17, uniform_decode=False) == (M.NONE, BatchDescriptor(17))


def test_max_num_seqs_limits_uniform_decode_graphs():
    d = make(M.FULL_AND_PIECEWISE, max_num_seqs=6)
    assert d.keys[M.FULL] == {U(s, s) for s in (1, 2, 4)}
    # Six one-token requests pad to 8 tokens, which would need 8 request slots: piecewise instead.
    assert d.dispatch(6, uniform_decode=True) == (M.PIECEWISE, BatchDescriptor(8))
    assert d.dispatch(4, uniform_decode=True) == (M.FULL, U(4, 4))
    decode_only = make(M.FULL_DECODE_ONLY, max_num_seqs=6)
    assert decode_only.dispatch(6, uniform_decode=True) == (M.NONE, BatchDescriptor(6))
    full = make(M.FULL, max_num_seqs=6)
    assert full.dispatch(6, uniform_decode=True) == (M.NONE, BatchDescriptor(6))


def test_multi_token_uniform_decode_counts_requests_by_query_len():
    """Uniform q-token batches pad their request count to a capture size: q x that many tokens."""
    d = make(M.FULL_AND_PIECEWISE, max_num_seqs=4, q=4, sizes=[1, 2, 4, 8, 12, 16, 24])
    assert d.keys[M.FULL] == {U(4, 1, 4), U(8, 2, 4), U(16, 4, 4)}
    assert d.dispatch(4, uniform_decode=True, query_len=4) == (M.FULL, U(4, 1, 4))
    assert d.dispatch(12, uniform_decode=True, query_len=4) == (M.FULL, U(16, 4, 4))
    # Five 4-token requests exceed max_num_seqs: the mixed graph of 24 tokens serves them.
    assert d.dispatch(20, uniform_decode=True, query_len=4) == (M.PIECEWISE, BatchDescriptor(24))
    # No graph larger than the largest capture size: 4 requests of 3 tokens fit, 8 of 3 would not.
    odd = make(M.FULL_AND_PIECEWISE, q=3, sizes=[1, 2, 4, 8, 12])
    assert odd.keys[M.FULL] == {U(3, 1, 3), U(6, 2, 3), U(12, 4, 3)}
    assert odd.dispatch(6, uniform_decode=True, query_len=3) == (M.FULL, U(6, 2, 3))
    assert odd.dispatch(9, uniform_decode=True, query_len=3) == (M.FULL, U(12, 4, 3))
    # A "uniform" count that is not a whole number of requests is served as a mixed batch.
    assert odd.dispatch(7, uniform_decode=True, query_len=3) == (M.PIECEWISE, BatchDescriptor(8))


def test_decode_and_verification_graphs_side_by_side():
    """Speculation with k = 4 drafts: plain decodes (q = 1) and full-length verifications (q = 5)
    each get their own FULL graphs; a verification of fewer drafts is a mixed batch."""
    d = CudagraphDispatcher([1, 2, 4, 8, 16, 32], M.FULL_AND_PIECEWISE, max_num_seqs=4, uniform_query_lens=(1, 5))
    assert {k for k in d.keys[M.FULL] if k.query_len == 5} == {U(5, 1, 5), U(10, 2, 5), U(20, 4, 5)}
    assert {k for k in d.keys[M.FULL] if k.query_len == 1} == {U(1, 1), U(2, 2), U(4, 4)}
    assert d.dispatch(1, True) == (M.FULL, U(1, 1))
    assert d.dispatch(5, True, query_len=5) == (M.FULL, U(5, 1, 5))
    assert d.dispatch(15, True, query_len=5) == (M.FULL, U(20, 4, 5))  # 3 requests padded to 4
    assert d.dispatch(3, True, query_len=3) == (M.PIECEWISE, BatchDescriptor(4))  # 2 drafts: no q = 3 graphs
    assert d.dispatch(25, True, query_len=5) == (M.PIECEWISE, BatchDescriptor(32))  # 5 > max_num_seqs
    # The same token count, decodes against one verification: different graphs.
    assert d.dispatch(4, True) == (M.FULL, U(4, 4))
    captured = d.capture_descriptors()
    for n in range(1, 33):
        for q in (1, 5):
            mode, key = d.dispatch(n, True, q)
            assert (mode, key) in captured or mode is M.NONE
            assert key.num_tokens >= n


def test_capture_sizes_are_sorted_and_deduplicated():
    d = CudagraphDispatcher([8, 1, 4, 8, 2], M.PIECEWISE, max_num_seqs=8)
    assert d.capture_sizes == [1, 2, 4, 8]
    assert d.dispatch(3, False) == (M.PIECEWISE, BatchDescriptor(4))
    empty = CudagraphDispatcher([], M.FULL_AND_PIECEWISE, max_num_seqs=8)
    assert empty.dispatch(1, True) == (M.NONE, BatchDescriptor(1))


def test_capture_descriptors_cover_every_key_largest_first():
    d = make(M.FULL_AND_PIECEWISE, max_num_seqs=4)
    descs = d.capture_descriptors()
    assert {(mode, key) for mode, key in descs} == {
        (mode, key) for mode in (M.FULL, M.PIECEWISE) for key in d.keys[mode]
    }
    assert len(descs) == len(SIZES) + 3
    sizes = [key.num_tokens for _, key in descs]
    assert sizes == sorted(sizes, reverse=True)
    assert descs[0] == (M.PIECEWISE, BatchDescriptor(16))
    # Every dispatched graph key is one that was captured.
    for n in range(1, 17):
        for uniform in (False, True):
            mode, key = d.dispatch(n, uniform)
            assert (mode, key) in descs


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError):
        CudagraphDispatcher(SIZES, M.FULL, max_num_seqs=0)
    with pytest.raises(ValueError):
        CudagraphDispatcher(SIZES, M.FULL, max_num_seqs=4, uniform_query_lens=(0,))
    with pytest.raises(ValueError):
        CudagraphDispatcher(SIZES, M.FULL, max_num_seqs=4, uniform_query_lens=())
    with pytest.raises(ValueError):
        CudagraphDispatcher([0, 4], M.FULL, max_num_seqs=4)
    with pytest.raises(ValueError):
        make(M.PIECEWISE).dispatch(0, False)
