"""Collectives of the tensor-parallel group.

`compiled_llm::tp_all_reduce` is a custom op so that Dynamo traces it into the graph as one opaque
node and Inductor calls it from inside the compiled pieces (no graph break, no split): the row-
parallel layers' sums happen within the compiled code, and on GPUs within the CUDA graphs. The
other collectives run outside the model (logits, sampled ids) and are plain calls. The op times
nothing unless a benchmark asks, inside `timed_all_reduces`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compiled_llm.distributed.parallel_state import tensor_parallel

_lib = torch.library.Library("compiled_llm", "FRAGMENT")
_lib.define("tp_all_reduce(Tensor x) -> Tensor")


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    group = tensor_parallel()
    if group.world_size > 1:
        dist.all_reduce(out, group=group.group)
    return out


# What the op runs: `_all_reduce`, or its timed twin inside `timed_all_reduces` (a kernel cannot be
# registered twice, so the swap happens behind the registered one).
_implementation: Callable[[torch.Tensor], torch.Tensor] = _all_reduce


def _tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _implementation(x)


_lib.impl("tp_all_reduce", _tp_all_reduce, "CPU")
_lib.impl("tp_all_reduce", _tp_all_reduce, "CUDA")
torch.library.register_fake("compiled_llm::tp_all_reduce", lambda x: torch.empty_like(x), lib=_lib)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the group's ranks (the tensor itself on a single rank)."""
    if tensor_parallel().world_size == 1:
        return x
    return torch.ops.compiled_llm.tp_all_reduce(x)


def all_gather_last_dim(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every rank's `x` (whose last dim is that rank's share, `sizes[rank]`), concatenated along
    the last dim in rank order."""
    group = tensor_parallel()
    if group.world_size == 1:
        return x
    x = x.contiguous()
    parts = [x.new_empty(*x.shape[:-1], size) for size in sizes]
    dist.all_gather(parts, x, group=group.group)
    return torch.cat(parts, dim=-1)


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank (in place on the others: same shape and dtype)."""
    group = tensor_parallel()
    if group.world_size > 1:
        dist.broadcast(x, src=0, group=group.group)
    return x


@dataclass
class AllReduceTiming:
    """The all-reduces this process made inside `timed_all_reduces`, and their wall seconds (waits
    for the other ranks included)."""

    calls: int = 0
    seconds: float = 0.0


@contextmanager
def timed_all_reduces() -> Iterator[AllReduceTiming]:
    """Count and time this process's `tp_all_reduce` calls while inside, for benchmarks; outside,
    the op times nothing.

    Only calls that reach the op's Python kernel are seen: meaningful on CPUs. On CUDA a call times
    an asynchronous launch, and a CUDA graph replay makes no call at all.
    """
    global _implementation
    timing = AllReduceTiming()

    def timed(x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = _all_reduce(x)
        timing.calls += 1
        timing.seconds += time.perf_counter() - started
        return out

    _implementation = timed
    try:
        yield timing
    finally:
        _implementation = _all_reduce
