"""Counts of what the compiler side did, so tests can assert on work done rather than on timing.

They are the one tally: each event is counted once, where it happens (the adaptor counts
compilations, saves and loads; the backend counts graphs and pieces), and what one start did
(`CompileReport`) is the difference between two snapshots.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


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
    num_fused_sites: int = 0  # sites the compiler passes rewrote (every pass together)
    num_cudagraph_captured: int = 0
    # Calls served by replaying an already captured graph (the replay that ends a capture is not one).
    num_cudagraph_replayed: int = 0
    cudagraph_capture_seconds: float = 0.0  # wall time of the captures (the start-up line shows it)

    def reset(self) -> None:
        self.__dict__.update(CompilationCounters().__dict__)

    def snapshot(self) -> "CompilationCounters":
        return copy.copy(self)


counters = CompilationCounters()


@dataclass(frozen=True)
class CompileReport:
    """What one start-up did, for the log line and `precompile --json`: the counters' difference
    between its beginning and its end."""

    pieces: int = 0
    unique_pieces: int = 0
    inductor_compilations: int = 0
    artifacts_saved: int = 0
    artifacts_loaded: int = 0
    traced: bool = False  # False: a warm start that loaded the saved graph instead of running Dynamo
    cache_dir: str = ""
    compile_ranges: list[tuple[int, int]] = field(default_factory=list)
    compile_sizes: list[int] = field(default_factory=list)

    @classmethod
    def between(cls, before: CompilationCounters, after: CompilationCounters, **static) -> "CompileReport":
        return cls(
            pieces=after.num_pieces - before.num_pieces,
            unique_pieces=after.num_unique_pieces - before.num_unique_pieces,
            inductor_compilations=after.num_inductor_compilations - before.num_inductor_compilations,
            artifacts_saved=after.num_artifacts_saved - before.num_artifacts_saved,
            artifacts_loaded=after.num_artifacts_loaded - before.num_artifacts_loaded,
            traced=after.num_graphs_traced > before.num_graphs_traced,
            **static,
        )
