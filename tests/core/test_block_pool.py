"""Block pool and prefix cache: unit behaviour plus Hypothesis-driven invariants."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from compiled_llm.core.block_hash import hash_block_tokens
from compiled_llm.core.block_pool import BlockPool
from compiled_llm.core.kv_cache_manager import KVCacheManager
from compiled_llm.core.request import Request
from compiled_llm.sampling_params import SamplingParams

BLOCK = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), [], BLOCK)


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    got = pool.allocate(4)
    assert 0 not in [b.block_id for b in got]
    assert pool.num_free_blocks == 0


def test_freed_cached_blocks_are_evicted_last_in_lru_order():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free([a])  # cached: to the tail
    pool.free([c])  # uncached: to the head
    pool.free([b])  # cached: to the tail, after a
    order = [blk.block_id for blk in pool.free_queue]
    assert order[0] == c.block_id  # uncached first
    assert order[-2:] == [a.block_id, b.block_id]  # least recently freed cached block first
    # Allocating everything evicts the cached ones last and drops their hashes.
    pool.allocate(pool.num_free_blocks)
    assert pool.get_cached_block(b"a") is None and pool.get_cached_block(b"b") is None


def test_block_hashes_are_chained_and_stable():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])  # deterministic (not salted per process)
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])


def test_prefix_hit_is_capped_below_the_whole_prompt():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK)
    first = make_request("a", list(range(8)))  # exactly two full blocks
    assert kv.allocate_slots(first, 8) is not None
    second = make_request("b", list(range(8)))
    hits, num = kv.get_computed_blocks(second)
    assert num == 4, "the last token must be computed: only the first block may hit"
    third = make_request("c", list(range(9)))
    hits, num = kv.get_computed_blocks(third)
    assert num == 8 and [b.block_id for b in hits] == kv.block_ids("a")


def test_hit_on_a_freed_block_takes_it_off_the_free_queue():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)  # 3 usable blocks
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.pool.num_free_blocks == 3
    b = make_request("b", list(range(9)))
    hits, num = kv.get_computed_blocks(b)
    b.num_computed_tokens = num
    assert kv.allocate_slots(b, 9 - num, hits) is not None
    assert kv.pool.num_free_blocks == 0
    assert all(blk.ref_cnt == 1 for blk in kv.req_blocks["b"])


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random add / grow / free sequences over a small pool keep every invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BLOCK)
        self.live: dict[str, Request] = {}
        self.counter = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 5), min_size=1, max_size=10))
    def add(self, prefix, tail):
        self.counter += 1
        request = make_request(f"r{self.counter}", prefix + tail)
        hits, num = self.kv.get_computed_blocks(request)
        assert num < request.num_tokens
        request.num_computed_tokens = num
        if self.kv.allocate_slots(request, request.num_tokens - num, hits) is not None:
            request.num_computed_tokens = request.num_tokens
            self.live[request.request_id] = request
        else:
            request.num_computed_tokens = 0

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 5))
    def grow(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live[rid]
        request.append_output_token(token)
        if self.kv.allocate_slots(request, 1) is not None:
            request.num_computed_tokens += 1
        else:
            self.kv.free(request)
            del self.live[rid]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))

    @invariant()
    def ref_counts_match_holders(self):
        pool = self.kv.pool
        held: dict[int, int] = {}
        for blocks in self.kv.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        free_ids = {b.block_id for b in pool.free_queue}
        for block in pool.blocks[1:]:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == held.get(block.block_id, 0)
            assert (block.block_id in free_ids) == (block.ref_cnt == 0), \
                "a free block is in use (or a used one is free)"
        assert pool.num_free_blocks == len(free_ids)
        assert 0 not in free_ids and 0 not in held

    @invariant()
    def cache_map_is_consistent(self):
        for block_hash, block in self.kv.pool.cached.items():
            assert block.block_hash == block_hash

    def teardown(self):
        for request in list(self.live.values()):
            self.kv.free(request)
        pool = self.kv.pool
        assert pool.num_free_blocks == pool.num_blocks - 1, "blocks leaked"


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
@settings(max_examples=100, deadline=None)
def test_cached_content_matches_tokens(tokens):
    """Any hit returns blocks whose hashes equal the request's own block hashes."""
    kv = KVCacheManager(num_blocks=30, block_size=BLOCK)
    a = make_request("a", tokens)
    kv.allocate_slots(a, len(tokens))
    b = make_request("b", tokens + [9])
    hits, num = kv.get_computed_blocks(b)
    assert [h.block_hash for h in hits] == b.block_hashes[: len(hits)]
    assert num == min(len(tokens) // BLOCK, len(b.block_hashes)) * BLOCK
