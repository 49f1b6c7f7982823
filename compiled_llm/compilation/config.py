"""How the model is compiled: optimization level, shape ranges, cache, CUDA-graph mode."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

# The ops the traced graph is split around. They run eagerly between the compiled pieces.
DEFAULT_SPLITTING_OPS = ("compiled_llm::attention",)


# Inductor settings per device, chosen by measurement (see the README's performance notes).
# On a CPU, batch-1 decode is dominated by Python overhead around small pieces: dropping the
# generated size/stride asserts saved ~10% of a SmolLM2 decode step; cpp_wrapper did not help;
# freezing cannot be saved as a standalone artifact (torch 2.13), so it cannot be cached.
# `cpp.threads: 1`: Inductor's own kernels (norms, rotary, SiLU: a few percent of any step) run on
# the calling thread. Generated for N threads, each would open an OpenMP region even for the one
# row of a batch-1 decode: 120 more fork/join barriers a step, and on a loaded machine a barrier
# waits for a descheduled thread (decode steps 3-6x slower). The matmuls and attention keep every
# thread (the C++ kernels parallelise themselves), and the artifacts no longer depend on the thread
# count they were compiled with, which the cache key does not record.
DEFAULT_INDUCTOR_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"size_asserts": False, "cpp.threads": 1},
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


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM's shape of capture sizes: 1, 2, 4, then multiples of 8 up to a bound set by max_num_seqs."""
    limit = min(max(max_num_seqs * 2, 8), 512, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= limit]
    sizes += list(range(8, limit + 1, 8))
    return sizes


@dataclass
class CompilationConfig:
    """How the model is compiled, every value resolved for the device and the scheduler's limits:
    build one with `CompilationConfig.resolve` (which also checks the settings)."""

    level: int  # -O: 0 eager, 1 compiled pieces, 2 pieces + CUDA graphs
    cache_dir: str  # root of the compile cache
    compile_ranges: list[tuple[int, int]]  # token-count ranges compiled symbolically
    compile_sizes: list[int]  # token counts compiled for their exact shape
    splitting_ops: list[str]
    require_cache_hit: bool
    cudagraph_mode: CUDAGraphMode
    cudagraph_capture_sizes: list[int]
    inductor_options: dict[str, Any]
    # Graph passes run on the traced graph before it is split (compilation/pass_manager.py).
    passes: list[str]
    # A file holding a secret key: precompile signs the cache entry with it, and a start accepts
    # only an entry signed with it. Never part of the cache key, never logged.
    cache_signing_key_file: str | None = None

    @classmethod
    def resolve(
        cls,
        device_type: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        level: int | None = None,
        cache_dir: str | None = None,
        compile_ranges: list[tuple[int, int]] | None = None,
        compile_sizes: Sequence[int] = (),
        splitting_ops: Sequence[str] = DEFAULT_SPLITTING_OPS,
        require_cache_hit: bool = False,
        cudagraph_mode: CUDAGraphMode | None = None,
        cudagraph_capture_sizes: Sequence[int] | None = None,
        inductor_options: dict[str, Any] | None = None,
        cache_signing_key_file: str | None = None,
        passes: Sequence[str] | None = None,
    ) -> "CompilationConfig":
        """The config for `device_type`, a None standing for the default: -O2 on a GPU and -O1 on a
        CPU, one range [1, max_num_batched_tokens], the cache under the user cache dir, full and
        piecewise CUDA graphs at -O2 on a GPU (none elsewhere), the device's Inductor options, every
        compiler pass (each fuses only where its pattern occurs)."""
        from compiled_llm.compilation.compile_cache import default_cache_root
        from compiled_llm.compilation.pass_manager import DEFAULT_PASSES, check_pass_names

        if level is None:
            level = 2 if device_type == "cuda" else 1
        if level not in (0, 1, 2):
            raise ValueError(f"optimization level must be 0, 1 or 2, got {level}.")
        ranges = sorted((int(lo), int(hi)) for lo, hi in (compile_ranges or [(1, max_num_batched_tokens)]))
        for lo, hi in ranges:
            if not 1 <= lo <= hi <= max_num_batched_tokens:
                raise ValueError(
                    f"compile range [{lo}, {hi}] must lie within [1, max_num_batched_tokens="
                    f"{max_num_batched_tokens}]."
                )
        for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
            if lo <= hi:
                raise ValueError(f"compile ranges overlap: {ranges}.")
        sizes = sorted({int(s) for s in compile_sizes})
        for s in sizes:
            if not 1 <= s <= max_num_batched_tokens:
                raise ValueError(f"compile size {s} is outside [1, {max_num_batched_tokens}].")
        # Every step size must have code compiled at start-up: nothing compiles while serving.
        bounds = [(0, 0), *ranges, (max_num_batched_tokens + 1, max_num_batched_tokens + 1)]
        for (_, hi), (lo, _) in zip(bounds, bounds[1:]):
            uncovered = [n for n in range(hi + 1, lo) if n not in set(sizes)]
            if uncovered:
                raise ValueError(
                    f"compile ranges {ranges} and sizes {sizes} leave token counts "
                    f"{uncovered[0]}..{uncovered[-1]} of [1, max_num_batched_tokens={max_num_batched_tokens}] "
                    f"without compiled code."
                )
        if device_type != "cuda":
            cudagraph_mode = CUDAGraphMode.NONE
        elif cudagraph_mode is None:
            cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE if level >= 2 else CUDAGraphMode.NONE
        if cudagraph_capture_sizes is None:
            cudagraph_capture_sizes = default_capture_sizes(max_num_seqs, max_num_batched_tokens)
        return cls(
            level=level,
            cache_dir=str(cache_dir or default_cache_root()),
            compile_ranges=ranges,
            compile_sizes=sizes,
            splitting_ops=list(splitting_ops),
            require_cache_hit=require_cache_hit,
            cudagraph_mode=cudagraph_mode,
            cudagraph_capture_sizes=sorted({s for s in cudagraph_capture_sizes if 1 <= s <= max_num_batched_tokens}),
            inductor_options=dict(DEFAULT_INDUCTOR_OPTIONS.get(device_type, {}) if inductor_options is None
                                  else inductor_options),
            passes=check_pass_names(list(DEFAULT_PASSES if passes is None else passes)),
            cache_signing_key_file=cache_signing_key_file,
        )
