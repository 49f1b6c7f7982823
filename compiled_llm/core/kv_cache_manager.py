"""Which KV-cache blocks each request holds: allocation, prefix-cache lookup, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from compiled_llm.core.block_pool import BlockPool, KVCacheBlock
from compiled_llm.core.request import Request
from compiled_llm.utils import cdiv


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found

    def take(self) -> "PrefixCacheStats":
        out = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return out


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are hashed
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens.

        Capped one token short of the whole request, so the last token is always computed
        (its logits are needed).
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit: int) -> None:
        """Count a lookup once, when its request is admitted (a request left waiting is looked up
        again next step and must not count twice)."""
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`, or return None if the pool
        cannot (nothing changes then). `new_computed_blocks` are prefix-cache hits being adopted
        on admission; `request.num_computed_tokens` already counts them."""
        new_computed_blocks = new_computed_blocks or []
        held = self.req_blocks.get(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = needed - len(held) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once adopted.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Blocks filled by this step are cached now: the step computes them before any later
            # step can read them, and a request admitted in the same step reads them after the
            # attention op has written them.
            self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        blocks = self.req_blocks[rid]
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        if end > start:
            self.num_cached_blocks[rid] = end

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
