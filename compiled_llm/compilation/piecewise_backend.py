"""One compiled piece at run time: its runnables per compile range and static size.

An exact compile size wins over the range that holds it. Everything is compiled or loaded at
start-up; a token count outside every range is an error, never a lazy compilation.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ShapeSpec:
    """A static size (`lo == hi`, `static=True`) or a symbolic range [lo, hi]."""

    lo: int
    hi: int
    static: bool = False

    @property
    def tag(self) -> str:
        return f"s{self.lo}" if self.static else f"r{self.lo}-{self.hi}"

    def __str__(self) -> str:
        return f"size {self.lo}" if self.static else f"range [{self.lo}, {self.hi}]"


def shape_specs(ranges: list[tuple[int, int]], sizes: list[int]) -> list[ShapeSpec]:
    return [ShapeSpec(lo, hi) for lo, hi in ranges] + [ShapeSpec(s, s, static=True) for s in sizes]


class PiecewiseBackend:
    def __init__(self, name: str, token_arg: tuple[int, bool], runnables: dict[ShapeSpec, Callable[..., Any]]) -> None:
        self.name = name
        self.token_index, self.token_is_int = token_arg
        self.sizes = {spec.lo: fn for spec, fn in runnables.items() if spec.static}
        ranged = sorted((spec.lo, spec.hi, fn) for spec, fn in runnables.items() if not spec.static)
        self.range_starts = [lo for lo, _, _ in ranged]
        self.ranges = ranged
        self.last_spec: str | None = None  # for tests: which runnable served the last call

    def num_tokens(self, args: tuple[Any, ...]) -> int:
        value = args[self.token_index]
        return int(value) if self.token_is_int else int(value.shape[0])

    def select(self, num_tokens: int) -> Callable[..., Any]:
        fn = self.sizes.get(num_tokens)
        if fn is not None:
            self.last_spec = f"s{num_tokens}"
            return fn
        i = bisect.bisect_right(self.range_starts, num_tokens) - 1
        if i >= 0:
            lo, hi, fn = self.ranges[i]
            if num_tokens <= hi:
                self.last_spec = f"r{lo}-{hi}"
                return fn
        raise RuntimeError(
            f"{self.name}: no compiled code for {num_tokens} tokens (ranges "
            f"{[(lo, hi) for lo, hi, _ in self.ranges]}, sizes {sorted(self.sizes)}); "
            f"the scheduler must keep steps within max_num_batched_tokens."
        )

    def __call__(self, *args: Any) -> Any:
        return self.select(self.num_tokens(args))(*args)
