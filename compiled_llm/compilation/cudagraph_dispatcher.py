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

    A uniform-decode batch (every request has exactly `uniform_decode_query_len` new tokens)
    gets a FULL graph keyed by `BatchDescriptor(padded, padded // q, uniform=True)` when the
    mode allows full graphs and that many requests fit in `max_num_seqs`. Any other batch, and
    a uniform one without such a key, gets a PIECEWISE graph keyed by `BatchDescriptor(padded)`
    when the mode has piecewise graphs (PIECEWISE, FULL_AND_PIECEWISE). Full graphs are only
    ever captured for uniform decode, plain FULL included: a full graph bakes the request count
    of its capture into the attention launch, which only a uniform batch's descriptor fixes.

    A step with no key (too large, or the mode has no graph for its kind) runs eagerly as
    `(NONE, BatchDescriptor(num_tokens))`, unpadded: an unknown key is never an error.
    """

    def __init__(
        self,
        capture_sizes: Sequence[int],
        mode: CUDAGraphMode,
        max_num_seqs: int,
        uniform_decode_query_len: int = 1,
    ) -> None:
        if max_num_seqs < 1 or uniform_decode_query_len < 1:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}) and uniform_decode_query_len "
                f"({uniform_decode_query_len}) must be at least 1."
            )
        if any(size < 1 for size in capture_sizes):
            raise ValueError(f"capture sizes must be at least 1, got {list(capture_sizes)}.")
        self.capture_sizes = sorted(set(capture_sizes))
        self.mode = mode
        self.max_num_seqs = max_num_seqs
        self.uniform_decode_query_len = uniform_decode_query_len
        self.keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.FULL: set(),
            CUDAGraphMode.PIECEWISE: set(),
        }
        if mode.has_piecewise_cudagraphs():
            self.keys[CUDAGraphMode.PIECEWISE].update(BatchDescriptor(size) for size in self.capture_sizes)
        if mode.has_full_cudagraphs():
            q = uniform_decode_query_len
            self.keys[CUDAGraphMode.FULL].update(
                BatchDescriptor(size, size // q, uniform=True)
                for size in self.capture_sizes
                if size % q == 0 and size // q <= max_num_seqs
            )

    def dispatch(self, num_tokens: int, uniform_decode: bool) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and descriptor to set in the forward context for this step."""
        if num_tokens < 1:
            raise ValueError(f"a step has at least one token, got {num_tokens}.")
        if num_tokens % self.uniform_decode_query_len:
            uniform_decode = False  # not a whole number of requests: served as a mixed batch
        index = bisect.bisect_left(self.capture_sizes, num_tokens)
        if index < len(self.capture_sizes):
            padded = self.capture_sizes[index]
            if uniform_decode:
                key = BatchDescriptor(padded, padded // self.uniform_decode_query_len, uniform=True)
                if key in self.keys[CUDAGraphMode.FULL]:
                    return CUDAGraphMode.FULL, key
            key = BatchDescriptor(padded)
            if key in self.keys[CUDAGraphMode.PIECEWISE]:
                return CUDAGraphMode.PIECEWISE, key
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)

    def capture_descriptors(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every key to capture at start-up, largest first, so smaller graphs reuse the pool's memory."""
        return sorted(
            ((mode, key) for mode, keys in self.keys.items() for key in keys),
            key=lambda item: (-item[1].num_tokens, item[0].value, item[1].uniform),
        )
