"""The torch.compile backend: split the traced graph around the splitting ops, then compile (or
load from the compile cache) every other piece for each compile range and size.

Dynamo calls this once per traced graph. Everything happens here, at start-up: afterwards the
split graph runs compiled pieces and eager splitting ops, and nothing compiles lazily.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from tqdm.auto import tqdm

from compiled_llm.compilation.compile_cache import CompileCache, CompileCacheMissError
from compiled_llm.compilation.config import CompilationConfig
from compiled_llm.compilation.counters import counters
from compiled_llm.compilation.inductor_adaptor import CompiledPiece, InductorAdaptor, graph_returns_tuple
from compiled_llm.compilation.partition import Piece, split_graph, structural_hash
from compiled_llm.compilation.piecewise_backend import PiecewiseBackend, ShapeSpec, shape_specs
from compiled_llm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class CompileReport:
    """What one start-up did, for the log line and `precompile --json`."""

    pieces: int = 0
    unique_pieces: int = 0
    inductor_compilations: int = 0
    artifacts_saved: int = 0
    artifacts_loaded: int = 0
    compile_seconds: float = 0.0  # compiling or loading the pieces
    cache_dir: str = ""
    compile_ranges: list[tuple[int, int]] = field(default_factory=list)
    compile_sizes: list[int] = field(default_factory=list)


def record_piece_inputs(split: fx.GraphModule, example_inputs: list[Any]) -> dict[str, tuple[Any, ...]]:
    """The (fake) arguments each submodule is called with, from one run of the split graph
    under the tracing context's fake mode."""
    fake_mode = detect_fake_mode()
    fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    recorded: dict[str, tuple[Any, ...]] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            recorded[target] = args
            return super().call_module(target, args, kwargs)

    with fake_mode, enable_python_dispatcher():
        Recorder(split).run(*fake_inputs)
    return recorded


def token_symbol(example_inputs: list[Any]) -> sympy.Symbol | None:
    """The symbol of the dynamic token dimension (the first one Dynamo created)."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt) and isinstance(x.node.expr, sympy.Symbol):
            return x.node.expr
        if isinstance(x, torch.Tensor) and x.dim() and isinstance(x.shape[0], torch.SymInt):
            expr = x.shape[0].node.expr
            if isinstance(expr, sympy.Symbol):
                return expr
    return None


def token_argument(args: tuple[Any, ...], symbol: sympy.Symbol | None) -> tuple[int, bool]:
    """Where a piece can read the step's token count: (index, is an int argument)."""
    for i, a in enumerate(args):
        if isinstance(a, torch.SymInt) and a.node.expr == symbol:
            return i, True
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.dim() and isinstance(a.shape[0], torch.SymInt) and a.shape[0].node.expr == symbol:
            return i, False
    raise RuntimeError("a compiled piece has no input sized by the token dimension")


class CompilerBackend:
    def __init__(
        self, config: CompilationConfig, cache: CompileCache, max_num_batched_tokens: int, progress: bool = True
    ) -> None:
        self.config = config
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.progress = progress
        self.specs = shape_specs(config.compile_ranges or [(1, max_num_batched_tokens)], config.compile_sizes)
        self.adaptor = InductorAdaptor(config.inductor_options)
        self.report = CompileReport(
            cache_dir=str(cache.entry),
            compile_ranges=list(config.compile_ranges or []),
            compile_sizes=list(config.compile_sizes),
        )
        self.graphs_seen = 0
        self.piece_backends: list[PiecewiseBackend] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        counters.num_graphs_traced += 1
        self.graphs_seen += 1
        if self.graphs_seen > 1:
            counters.num_recompiles += 1
            logger.error("Dynamo traced the model a second time (a recompile): a bug in the traced code's guards.")
        started = time.perf_counter()
        before = (counters.num_inductor_compilations, counters.num_artifacts_saved, counters.num_artifacts_loaded)
        split, pieces = split_graph(gm, self.config.splitting_ops)
        inputs = record_piece_inputs(split, example_inputs)
        symbol = token_symbol(example_inputs)
        compiled = [p for p in pieces if not p.is_splitting_op]
        hashes = {p.name: structural_hash(p.graph) for p in compiled}
        unique: dict[str, Piece] = {}
        for p in compiled:
            unique.setdefault(hashes[p.name], p)
        counters.num_pieces += len(compiled)
        counters.num_unique_pieces += len(unique)
        shape_env = detect_fake_mode().shape_env
        with self.cache.locked():
            self.cache.prepare()
            artifacts = self._compile_or_load(unique, inputs, symbol, shape_env)
        for p in compiled:
            h = hashes[p.name]
            returns_tuple = graph_returns_tuple(p.graph)
            runnables = {spec: CompiledPiece(artifacts[h, spec], returns_tuple) for spec in self.specs}
            backend = PiecewiseBackend(p.name, token_argument(inputs[p.name], symbol), runnables)
            del split._modules[p.name]
            setattr(split, p.name, backend)
            self.piece_backends.append(backend)
        r = self.report
        r.pieces += len(compiled)
        r.unique_pieces += len(unique)
        r.inductor_compilations += counters.num_inductor_compilations - before[0]
        r.artifacts_saved += counters.num_artifacts_saved - before[1]
        r.artifacts_loaded += counters.num_artifacts_loaded - before[2]
        r.compile_seconds += time.perf_counter() - started
        return split

    def _artifact_name(self, piece_hash: str, spec: ShapeSpec) -> str:
        return f"{piece_hash}-{spec.tag}"

    def _compile_or_load(
        self, unique: dict[str, Piece], inputs: dict[str, tuple[Any, ...]], symbol: sympy.Symbol | None, shape_env: Any
    ) -> dict[tuple[str, ShapeSpec], Any]:
        cache = self.cache
        plan = [(h, spec) for h in unique for spec in self.specs]
        index = cache.read_index()
        artifacts: dict[tuple[str, ShapeSpec], Any] = {}
        misses: list[tuple[str, ShapeSpec]] = []
        try:
            for h, spec in plan:
                path = cache.verified_path(self._artifact_name(h, spec), index)
                if path is None:
                    misses.append((h, spec))
                else:
                    artifacts[h, spec] = self.adaptor.load(path)
        except Exception as e:  # a truncated, corrupt or incompatible artifact: never trusted
            cache.set_aside(f"{type(e).__name__}: {e}")
            index, artifacts, misses = {}, {}, list(plan)
        counters.num_cache_misses += len(misses)
        if misses and self.config.require_cache_hit:
            h, spec = misses[0]
            raise CompileCacheMissError(
                f"Compile cache miss in {cache.entry} with require_cache_hit: {len(misses)} of {len(plan)} "
                f"artifact(s) missing, e.g. {self._artifact_name(h, spec)} (piece {unique[h].name}, {spec}). "
                f"Run `compiled-llm precompile` with the same settings to fill it."
            )
        if misses:
            logger.info("Compiling %d artifact(s) for %d unique piece(s) into %s.", len(misses), len(unique), cache.entry)
        bar = tqdm(misses, desc="Compiling pieces", disable=not (self.progress and misses), dynamic_ncols=True)
        for h, spec in bar:
            piece = unique[h]
            artifact = self.adaptor.compile(
                piece.graph,
                list(inputs[piece.name]),
                symbol,
                shape_env,
                size=spec.lo if spec.static else None,
                hint=self._range_hint(spec),
            )
            name = self._artifact_name(h, spec)
            self.adaptor.save(artifact, cache.artifact_path(name))
            cache.record(name, index)
            cache.write_index(index)
            artifacts[h, spec] = artifact
        return artifacts

    @staticmethod
    def _range_hint(spec: ShapeSpec) -> int | None:
        """Tune a symbolic range for its upper end, capped so that big ranges tune for batched steps."""
        if spec.static:
            return None
        return max(2, min(spec.hi, 512))
