"""The n-gram index proposes exactly what a scan of the whole context would, token by token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.spec_decode.ngram import NgramIndex


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """For n from max_n down to min_n: the latest start i with tokens[i:i+n] equal to the last n
    tokens and a token after it (i + n < len), proposing the k tokens from i+n on, where position
    j >= len reads position j - (len - i - n) (the text repeating with that period)."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                extended = list(tokens)
                for j in range(length, i + n + k):
                    extended.append(extended[j - (length - i - n)])
                return extended[i + n : i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=30),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(1, 6),
)
def test_incremental_index_matches_a_full_scan(tokens, chunks, bounds, k):
    min_n, max_n = bounds[0], bounds[0] + bounds[1]
    split = len(tokens) // 2
    index = NgramIndex(min_n, max_n, tokens[:split])  # a prompt, then outputs in chunks of accepted tokens
    assert index.propose(k) == brute_force(tokens[:split], min_n, max_n, k)
    pos = split
    for size in chunks:
        if pos >= len(tokens):
            break
        index.extend(tokens[pos : pos + size])
        pos = min(pos + size, len(tokens))
        assert index.propose(k) == brute_force(tokens[:pos], min_n, max_n, k)


def test_proposes_what_followed_the_latest_occurrence():
    #        0  1  2  3  4  5  6  7  8  9
    index = NgramIndex(1, 3, [7, 8, 9, 1, 7, 8, 9, 2, 7, 8])
    assert index.propose(3) == [9, 2, 7]  # "7 8" last seen at 4-5, followed by 9 2 7
    index.extend([9])
    # "7 8 9" at 4-6, followed by 2 7 8 9 and the end: the four-token loop goes on.
    assert index.propose(6) == [2, 7, 8, 9, 2, 7]
    assert NgramIndex(2, 4, [5, 5, 5]).propose(4) == [5, 5, 5, 5]  # a one-token loop: k drafts, not 1
    assert NgramIndex(2, 2, [1, 2, 3]).propose(2) == []  # "2 3" never came before
    assert NgramIndex(1, 1, []).propose(2) == []


def test_a_shortest_match_leaves_out_proposals_from_shorter_ones():
    index = NgramIndex(1, 3, [1, 2, 9, 4, 2, 9])  # "2 9" matched at 1-2 (followed by 4); no 3-gram
    assert index.propose(2) == [4, 2]
    assert index.propose(2, shortest=2) == [4, 2]
    assert index.propose(2, shortest=3) == []
    index.extend([4])  # now "2 9 4" at 1-3, followed by 2 9
    assert index.propose(2, shortest=3) == [2, 9]
