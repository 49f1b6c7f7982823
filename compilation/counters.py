"""Counts of what the compiler side did, so tests can assert on work done rather than on timing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompilationCounters:
    """Process-wide tallies; each subsystem increments its own fields."""

    num_cudagraph_captured: int = 0
    # Calls served by replaying an already captured graph (the replay that ends a capture is not one).
    num_cudagraph_replayed: int = 0

    def reset(self) -> None:
        self.__dict__.update(CompilationCounters().__dict__)


counters = CompilationCounters()
