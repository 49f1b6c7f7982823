"""Which CUDA graph serves a step: the one place that turns a batch into a (mode, descriptor) key.

The wrappers trust the key blindly, so every rule about what is captured lives here: the capture
sizes, which batch kinds get full graphs, and the `max_num_seqs` limit on uniform-decode graphs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from compiled_llm.compilation.config import CUDAGraphMode
from compiled_llm.compilation.forward_context import BatchDescriptor


class CudagraphDispatcher:
    """Pads a step's token count to a capture size and picks the graph mode for it.

    A uniform batch (every request has the same q new tokens, q one of `uniform_query_lens`: 1
    for plain decode, 1 + k for speculative verification of k drafts) gets a FULL graph when the
    mode allows full graphs: its request count is padded to a capture size s (at most
    `max_num_seqs`, and q * s at most the largest capture size), keyed by
    `BatchDescriptor(q * s, s, uniform=True, query_len=q)`. Any other batch, and a uniform one
    without such a key, gets a PIECEWISE graph keyed by `BatchDescriptor(padded)` when the mode
    has piecewise graphs (PIECEWISE, FULL_AND_PIECEWISE). Full graphs are only ever captured for
    uniform batches, plain FULL included: a full graph bakes the request count of its capture into
    the attention launch, which only a uniform batch's descriptor fixes.

    A step with no key (too large, or the mode has no graph for its kind) runs eagerly as
    `(NONE, BatchDescriptor(num_tokens))`, unpadded: an unknown key is never an error.
    """

    def __init__(
        self,
        capture_sizes: Sequence[int],
        mode: CUDAGraphMode,
        max_num_seqs: int,
        uniform_query_lens: Sequence[int] = (1,),
    ) -> None:
        if max_num_seqs < 1 or not uniform_query_lens or min(uniform_query_lens) < 1:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}) and every uniform query length "
                f"({list(uniform_query_lens)}) must be at least 1."
            )
        if any(size < 1 for size in capture_sizes):
            raise ValueError(f"capture sizes must be at least 1, got {list(capture_sizes)}.")
        self.capture_sizes = sorted(set(capture_sizes))
        self.mode = mode
        self.max_num_seqs = max_num_seqs
        self.uniform_query_lens = sorted(set(uniform_query_lens))
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.FULL: set(),
            CUDAGraphMode.PIECEWISE: set(),
        }
        if mode.has_piecewise_cudagraphs():
            self.keys[CUDAGraphMode.PIECEWISE].update(BatchDescriptor(size) for size in self.capture_sizes)
        if mode.has_full_cudagraphs():
            largest = self.capture_sizes[-1] if self.capture_sizes else 0
            self.keys[CUDAGraphMode.FULL].update(
                self._uniform_key(size, q)
                for q in self.uniform_query_lens
                for size in self.capture_sizes
                if size <= max_num_seqs and size * q <= largest
            )

    @staticmethod
    def _uniform_key(num_reqs: int, query_len: int) -> BatchDescriptor:
        return BatchDescriptor(num_reqs * query_len, num_reqs, uniform=True, query_len=query_len)

    def dispatch(
        self, num_tokens: int, uniform_decode: bool, query_len: int = 1
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and descriptor to set in the forward context for this step.

        `uniform_decode`: every request of the step has `query_len` new tokens."""
        if num_tokens < 1:
            raise ValueError(f"a step has at least one token, got {num_tokens}.")
        if uniform_decode and num_tokens % query_len == 0:
            index = bisect.bisect_left(self.capture_sizes, num_tokens // query_len)
            if index < len(self.capture_sizes):
                key = self._uniform_key(self.capture_sizes[index], query_len)
                if key in self.keys[CUDAGraphMode.FULL]:
                    return CUDAGraphMode.FULL, key
        index = bisect.bisect_left(self.capture_sizes, num_tokens)
        if index < len(self.capture_sizes):
            key = BatchDescriptor(self.capture_sizes[index])
            if key in self.keys[CUDAGraphMode.PIECEWISE]:
                return CUDAGraphMode.PIECEWISE, key
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)

    def dispatch_batch(self, num_scheduled: Sequence[int]) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """`dispatch` for a step whose requests have these query lengths: uniform where they are
        all equal (the runner's and the draft model's steps alike)."""
        query_len = int(num_scheduled[0])
        uniform = all(int(n) == query_len for n in num_scheduled)
        return self.dispatch(int(sum(num_scheduled)), uniform, query_len)

    def capture_descriptors(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every key to capture at start-up, largest first, so smaller graphs reuse the pool's memory."""
        return sorted(
            ((mode, key) for mode, keys in self.keys.items() for key in keys),
            key=lambda item: (-item[1].num_tokens, item[0].value, item[1].uniform, item[1].query_len or 0),
        )
