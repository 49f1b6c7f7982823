"""Capture and replay of CUDA graphs, one graph per `BatchDescriptor`, behind a plain callable.

The wrapper owns only the graphs: it neither keeps nor fills input buffers. The caller promises
that every tensor input of a replay sits at the address it had at capture (persistent buffers
sliced from the start, or outputs of earlier graphs in the same pool); the optional debug check
turns a broken promise into an error instead of silently reading stale memory.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import patch

import torch
from torch.utils._pytree import tree_leaves, tree_map

from compiled_llm.compilation.config import CUDAGraphMode
from compiled_llm.compilation.counters import counters
from compiled_llm.compilation.forward_context import BatchDescriptor, peek_forward_context

DEBUG_ENV = "COMPILED_LLM_CUDAGRAPH_DEBUG"


@dataclass
class CUDAGraphState:
    """Process-wide capture state shared by every wrapper.

    One memory pool for all graphs lets each capture reuse memory the previous ones no longer
    hold (see `weak_ref_tensors`); one dedicated stream because capture cannot run on the
    legacy default stream.
    """

    capturing: bool = False
    collected: bool = False  # the capture phase's one gc.collect()/empty_cache() has run
    pool: Any = None  # torch.cuda.graph_pool_handle(), created by the first capture
    stream: torch.cuda.Stream | None = None


cudagraph_state = CUDAGraphState()


@contextmanager
def capture_phase() -> Iterator[None]:
    """Allow capturing new graphs (start-up only); outside it an unknown descriptor is an error."""
    previous = cudagraph_state.capturing, cudagraph_state.collected
    cudagraph_state.capturing, cudagraph_state.collected = True, False
    try:
        yield
    finally:
        cudagraph_state.capturing, cudagraph_state.collected = previous


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor viewing `tensor`'s memory without owning it.

    Used for captured outputs: once the caller drops the real output, its block returns to the
    graph pool and a later capture may reuse it, so pool memory is not pinned by every graph's
    outputs. Replays still write the captured addresses, which the pool keeps reserved while its
    graphs live. (The same non-owning storage torch's cudagraph trees rebuild outputs from.)
    """
    storage = tensor.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        alias, tensor.storage_offset(), tensor.size(), tensor.stride()
    )


def weak_ref_tensors(outputs: Any) -> Any:
    """`weak_ref_tensor` applied to every tensor in a (nested) output; other leaves are kept."""
    return tree_map(lambda x: weak_ref_tensor(x) if isinstance(x, torch.Tensor) else x, outputs)


def _input_addresses(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    return [x.data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


@dataclass
class CUDAGraphEntry:
    graph: torch.cuda.CUDAGraph
    output: Any  # non-owning views of the captured outputs; each replay rewrites them
    input_addresses: list[int] = field(default_factory=list)


class CUDAGraphWrapper:
    """Runs `runnable` through a CUDA graph when the forward context asks for this wrapper's mode.

    It passes straight through with no forward context, no descriptor, or a context mode other
    than its own, so a FULL wrapper around the whole model can sit over PIECEWISE wrappers
    around the compiled pieces and exactly one layer acts per call. Otherwise the first call
    for a descriptor captures (inside `capture_phase()` only) and later calls replay.

    A capture first runs `runnable` once eagerly on the capture stream (lazy initialisation
    such as cuBLAS workspaces and Triton compilation cannot happen inside a capture), then
    captures, then replays once: capturing records kernels without running them, and the
    replay makes the capturing call return real values like any later one.

    Returned tensors live in the shared graph pool and are valid until the next replay of any
    graph: copy what must outlive the step.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode,
        *,
        name: str | None = None,
        debug: bool | None = None,
    ) -> None:
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"a CUDAGraphWrapper runs FULL or PIECEWISE graphs, not {runtime_mode.name}.")
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.name = name or getattr(runnable, "__qualname__", type(runnable).__qualname__)
        # Checking every replay's input addresses costs a pass over the inputs, so it is opt-in.
        self.debug = os.environ.get(DEBUG_ENV, "0") not in ("", "0") if debug is None else debug
        self.entries: dict[BatchDescriptor, CUDAGraphEntry] = {}

    def __repr__(self) -> str:
        return f"CUDAGraphWrapper({self.name}, {self.runtime_mode.name})"

    def __getattr__(self, name: str) -> Any:
        """Reach the wrapped runnable's attributes (a wrapped model keeps `compute_logits` etc.)."""
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(name)
        return getattr(runnable, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = peek_forward_context()
        if (
            context is None
            or context.cudagraph_runtime_mode is not self.runtime_mode
            or context.batch_descriptor is None
        ):
            return self.runnable(*args, **kwargs)
        entry = self.entries.get(context.batch_descriptor)
        if entry is None:
            return self._capture(context.batch_descriptor, args, kwargs)
        if self.debug:
            self._check_input_addresses(context.batch_descriptor, entry, args, kwargs)
        entry.graph.replay()
        counters.num_cudagraph_replayed += 1
        return entry.output

    def _capture(self, descriptor: BatchDescriptor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = cudagraph_state
        if not state.capturing:
            raise RuntimeError(
                f"{self} has no graph for {descriptor} and the capture phase is over. Graphs are "
                "captured only inside capture_phase() at start-up: capture every descriptor of "
                "CudagraphDispatcher.capture_descriptors() there, and set only dispatched "
                "descriptors in the forward context."
            )
        if state.pool is None:
            state.pool = torch.cuda.graph_pool_handle()
            state.stream = torch.cuda.Stream()
        stream = state.stream

        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.runnable(*args, **kwargs)

        graph = torch.cuda.CUDAGraph()
        with ExitStack() as stack:
            if state.collected:
                # A piecewise model captures one graph per piece and size; collecting garbage
                # and emptying the cache before each would make start-up crawl.
                stack.enter_context(patch("gc.collect", lambda *a, **k: 0))
                stack.enter_context(patch("torch.cuda.empty_cache", lambda: None))
            else:
                gc.collect()  # torch.cuda.graph empties the cache itself
                state.collected = True
            stack.enter_context(torch.cuda.graph(graph, pool=state.pool, stream=stream))
            output = self.runnable(*args, **kwargs)
        graph.replay()

        self.entries[descriptor] = CUDAGraphEntry(
            graph, weak_ref_tensors(output), _input_addresses(args, kwargs)
        )
        counters.num_cudagraph_captured += 1
        # The strong output goes to the caller so its memory stays live for as long as the caller
        # uses it, exactly as it will be at replay; only the entry's copy is weak.
        return output

    def _check_input_addresses(
        self, descriptor: BatchDescriptor, entry: CUDAGraphEntry, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        addresses = _input_addresses(args, kwargs)
        if len(addresses) != len(entry.input_addresses):
            raise RuntimeError(
                f"{self} replaying {descriptor}: got {len(addresses)} tensor inputs, "
                f"captured with {len(entry.input_addresses)}."
            )
        for i, (now, captured) in enumerate(zip(addresses, entry.input_addresses)):
            if now != captured:
                raise RuntimeError(
                    f"{self} replaying {descriptor}: tensor input {i} sits at {now:#x} but was "
                    f"captured at {captured:#x}. A graph reads its inputs from the captured "
                    "addresses: copy new values into the persistent buffers instead of passing "
                    "new tensors."
                )
