"""Counts of what the compiler side did, so tests can assert on work done rather than on timing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompilationCounters:
    """Process-wide tallies; each subsystem increments its own fields."""

    num_graphs_traced: int = 0  # Dynamo graphs handed to the backend (more than one per model = a recompile)
    num_recompiles: int = 0
    num_pieces: int = 0  # compiled (non-splitting) pieces
    num_unique_pieces: int = 0  # distinct pieces by structure: what is actually compiled
    num_inductor_compilations: int = 0
    num_artifacts_saved: int = 0
    num_artifacts_loaded: int = 0
    num_cache_misses: int = 0
    num_cudagraph_captured: int = 0
    # Calls served by replaying an already captured graph (the replay that ends a capture is not one).
    num_cudagraph_replayed: int = 0

    def reset(self) -> None:
        self.__dict__.update(CompilationCounters().__dict__)


counters = CompilationCounters()
