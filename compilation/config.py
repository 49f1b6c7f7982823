"""How the model is compiled: optimization level, shape ranges, cache, CUDA-graph mode."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# The ops the traced graph is split around. They run eagerly between the compiled pieces.
DEFAULT_SPLITTING_OPS = ("compiled_llm::attention",)


# Inductor settings per device, chosen by measurement (see the README's performance notes).
# On a CPU, batch-1 decode is dominated by Python overhead around small pieces: dropping the
# generated size/stride asserts saved ~10% of a SmolLM2 decode step; cpp_wrapper did not help;
# freezing cannot be saved as a standalone artifact (torch 2.13), so it cannot be cached.
DEFAULT_INDUCTOR_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"size_asserts": False},
    "cuda": {},
}


class CUDAGraphMode(enum.Enum):
    """Which CUDA graphs are captured and replayed.

    The two-part modes name the mode for uniform decode batches first and for every other
    batch second.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def decode_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[0]) if isinstance(self.value, tuple) else self

    def mixed_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[1]) if isinstance(self.value, tuple) else self

    def has_full_cudagraphs(self) -> bool:
        return CUDAGraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def has_piecewise_cudagraphs(self) -> bool:
        return CUDAGraphMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM's shape of capture sizes: 1, 2, 4, then multiples of 8 up to a bound set by max_num_seqs."""
    limit = min(max(max_num_seqs * 2, 8), 512, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= limit]
    sizes += list(range(8, limit + 1, 8))
    return sizes


@dataclass
class CompilationConfig:
    level: int | None = None  # -O: 0 eager, 1 compiled pieces, 2 pieces + CUDA graphs; None: per device
    cache_dir: str | None = None  # root of the compile cache; None: under the user cache dir
    compile_ranges: list[tuple[int, int]] | None = None  # None: one range [1, max_num_batched_tokens]
    compile_sizes: list[int] = field(default_factory=list)
    splitting_ops: list[str] = field(default_factory=lambda: list(DEFAULT_SPLITTING_OPS))
    require_cache_hit: bool = False
    cudagraph_mode: CUDAGraphMode | None = None  # None: FULL_AND_PIECEWISE at -O2, else NONE
    cudagraph_capture_sizes: list[int] | None = None
    inductor_options: dict[str, Any] | None = None  # None: DEFAULT_INDUCTOR_OPTIONS for the device
    # A file holding a secret key: precompile signs the cache entry with it, and a start accepts
    # only an entry signed with it. Never part of the cache key, never logged.
    cache_signing_key_file: str | None = None

    def resolve(self, device_type: str, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Fill every `None` with the default for the device and the scheduler's limits."""
        if self.level is None:
            self.level = 2 if device_type == "cuda" else 1
        if self.level not in (0, 1, 2):
            raise ValueError(f"optimization level must be 0, 1 or 2, got {self.level}.")
        if self.compile_ranges is None:
            self.compile_ranges = [(1, max_num_batched_tokens)]
        self.compile_ranges = sorted((int(lo), int(hi)) for lo, hi in self.compile_ranges)
        for lo, hi in self.compile_ranges:
            if not 1 <= lo <= hi <= max_num_batched_tokens:
                raise ValueError(
                    f"compile range [{lo}, {hi}] must lie within [1, max_num_batched_tokens="
                    f"{max_num_batched_tokens}]."
                )
        for (_, hi), (lo, _) in zip(self.compile_ranges, self.compile_ranges[1:]):
            if lo <= hi:
                raise ValueError(f"compile ranges overlap: {self.compile_ranges}.")
        self.compile_sizes = sorted({int(s) for s in self.compile_sizes})
        for s in self.compile_sizes:
            if not 1 <= s <= max_num_batched_tokens:
                raise ValueError(f"compile size {s} is outside [1, {max_num_batched_tokens}].")
        # Every step size must have code compiled at start-up: nothing compiles while serving.
        bounds = [(0, 0), *self.compile_ranges, (max_num_batched_tokens + 1, max_num_batched_tokens + 1)]
        sizes = set(self.compile_sizes)
        for (_, hi), (lo, _) in zip(bounds, bounds[1:]):
            uncovered = [n for n in range(hi + 1, lo) if n not in sizes]
            if uncovered:
                raise ValueError(
                    f"compile ranges {self.compile_ranges} and sizes {self.compile_sizes} leave token counts "
                    f"{uncovered[0]}..{uncovered[-1]} of [1, max_num_batched_tokens={max_num_batched_tokens}] "
                    f"without compiled code."
                )
        if self.cudagraph_mode is None:
            on_gpu = device_type == "cuda" and self.level >= 2
            self.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE if on_gpu else CUDAGraphMode.NONE
        if device_type != "cuda":
            self.cudagraph_mode = CUDAGraphMode.NONE
        if self.inductor_options is None:
            self.inductor_options = dict(DEFAULT_INDUCTOR_OPTIONS.get(device_type, {}))
        if self.cudagraph_capture_sizes is None:
            self.cudagraph_capture_sizes = default_capture_sizes(max_num_seqs, max_num_batched_tokens)
        self.cudagraph_capture_sizes = sorted(
            {s for s in self.cudagraph_capture_sizes if 1 <= s <= max_num_batched_tokens}
        )
