"""The torch.compile backend: split the traced graph around the splitting ops, then compile (or
load from the compile cache) every other piece for each compile range and size.

Dynamo calls this once, on a cold start. Everything happens then, at start-up: afterwards the
split graph runs compiled pieces and eager splitting ops, and nothing compiles lazily. The
traced graph is saved beside the artifacts, so a warm start (`load_saved`) skips Dynamo too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from tqdm.auto import tqdm

from compiled_llm.compilation import traced_graph
from compiled_llm.compilation.compile_cache import CompileCache, CompileCacheMissError
from compiled_llm.compilation.config import CompilationConfig, CUDAGraphMode
from compiled_llm.compilation.cuda_graph import CUDAGraphWrapper
from compiled_llm.compilation.counters import counters
from compiled_llm.compilation.inductor_adaptor import CompiledPiece, InductorAdaptor, graph_returns_tuple
from compiled_llm.compilation.partition import split_graph, structural_hash
from compiled_llm.compilation.piecewise_backend import PiecewiseBackend, ShapeSpec, shape_specs
from compiled_llm.compilation.traced_graph import PieceMeta, TracedGraph
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
    traced: bool = False  # False: a warm start that loaded the saved graph instead of running Dynamo
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


class _WarmLoadFailed(Exception):
    """The warm path found an artifact it could not use (already set aside)."""


class CompilerBackend:
    def __init__(
        self,
        config: CompilationConfig,
        cache: CompileCache,
        max_num_batched_tokens: int,
        model: torch.nn.Module,
        progress: bool = True,
    ) -> None:
        self.config = config
        self.cache = cache
        self.progress = progress
        self.specs = shape_specs(config.compile_ranges or [(1, max_num_batched_tokens)], config.compile_sizes)
        self.adaptor = InductorAdaptor(config.inductor_options)
        self.report = CompileReport(
            cache_dir=str(cache.entry),
            compile_ranges=list(config.compile_ranges or []),
            compile_sizes=list(config.compile_sizes),
        )
        self.named_tensors = {id(t): n for n, t in model.named_parameters(remove_duplicate=False)}
        self.named_tensors.update({id(t): n for n, t in model.named_buffers(remove_duplicate=False)})
        self.inputs: Sequence[torch.Tensor] = ()  # the forward's inputs of the tracing call
        self.graphs_seen = 0
        self.piece_backends: list[PiecewiseBackend] = []
        self.split: fx.GraphModule | None = None
        self.traced: TracedGraph | None = None

    # ---- cold start: Dynamo hands us its graph --------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        counters.num_graphs_traced += 1
        self.graphs_seen += 1
        if self.graphs_seen > 1:
            counters.num_recompiles += 1
            logger.error("Dynamo traced the model a second time (a recompile): a bug in the traced code's guards.")
        self.report.traced = True
        bindings = traced_graph.bind_placeholders(example_inputs, self.named_tensors, self.inputs)
        split, pieces = split_graph(gm, self.config.splitting_ops)
        inputs = record_piece_inputs(split, example_inputs)
        symbol = token_symbol(example_inputs)
        metas = []
        for p in pieces:
            if not p.is_splitting_op:
                index, is_int = token_argument(inputs[p.name], symbol)
                metas.append(PieceMeta(p.name, structural_hash(p.graph), index, is_int, graph_returns_tuple(p.graph)))
        graphs = {p.name: p.graph for p in pieces}
        shape_env = detect_fake_mode().shape_env

        def compile_piece(meta: PieceMeta, spec: ShapeSpec) -> Any:
            return self.adaptor.compile(
                graphs[meta.name], list(inputs[meta.name]), symbol, shape_env,
                size=spec.lo if spec.static else None, hint=self._range_hint(spec),
            )

        with self.cache.locked():
            self.cache.prepare()
            artifacts = self._compile_or_load(metas, compile_piece)
            self.traced = TracedGraph(traced_graph.strip_graph(split, [m.name for m in metas]), bindings, metas)
            traced_graph.save(self.cache.entry, self.traced)
        self._install(split, metas, artifacts)
        return split

    # ---- warm start: the saved graph and its artifacts ------------------------------------------
    def load_saved(self) -> TracedGraph | None:
        """Rebuild from the cache entry without Dynamo; None if the entry cannot serve this start
        (no saved graph, or artifacts missing or broken: the cold path then repairs it)."""
        with self.cache.locked():
            saved = traced_graph.load(self.cache.entry)
            if saved is None:
                return None
            index = self.cache.read_index()
            try:
                if any(self.cache.verified_path(self._name(m.piece_hash, s), index) is None
                       for m in saved.pieces for s in self.specs):
                    return None
            except ValueError:  # a checksum mismatch: let the cold path set the entry aside
                return None
            self.cache.prepare()
            try:
                artifacts = self._compile_or_load(saved.pieces, None)
            except _WarmLoadFailed:  # an artifact would not load: the cold path rebuilds the entry
                return None
        split = saved.graph
        self._install(split, saved.pieces, artifacts)
        self.traced = saved
        return saved

    # ---- shared ---------------------------------------------------------------------------------
    def _install(self, split: fx.GraphModule, metas: list[PieceMeta], artifacts: dict[tuple[str, ShapeSpec], Any]) -> None:
        piecewise = bool(self.config.cudagraph_mode and self.config.cudagraph_mode.has_piecewise_cudagraphs())
        for meta in metas:
            runnables = {spec: CompiledPiece(artifacts[meta.piece_hash, spec], meta.returns_tuple) for spec in self.specs}
            backend = PiecewiseBackend(meta.name, (meta.token_index, meta.token_is_int), runnables)
            del split._modules[meta.name]
            # Under piecewise CUDA graphs each compiled piece is captured and replayed by itself.
            runnable = CUDAGraphWrapper(backend, CUDAGraphMode.PIECEWISE, name=meta.name) if piecewise else backend
            setattr(split, meta.name, runnable)
            self.piece_backends.append(backend)
        self.split = split
        counters.num_pieces += len(metas)
        unique = len({m.piece_hash for m in metas})
        counters.num_unique_pieces += unique
        self.report.pieces += len(metas)
        self.report.unique_pieces += unique

    @staticmethod
    def _name(piece_hash: str, spec: ShapeSpec) -> str:
        return f"{piece_hash}-{spec.tag}"

    def _compile_or_load(self, metas: list[PieceMeta], compile_piece: Any) -> dict[tuple[str, ShapeSpec], Any]:
        """Load every (unique piece, spec) artifact the index vouches for; compile the rest
        (`compile_piece` is None on the warm path, where nothing may be missing)."""
        cache = self.cache
        first = {}
        for meta in metas:
            first.setdefault(meta.piece_hash, meta)
        plan = [(h, spec) for h in first for spec in self.specs]
        index = cache.read_index()
        artifacts: dict[tuple[str, ShapeSpec], Any] = {}
        misses: list[tuple[str, ShapeSpec]] = []
        try:
            for h, spec in plan:
                path = cache.verified_path(self._name(h, spec), index)
                if path is None:
                    misses.append((h, spec))
                else:
                    artifacts[h, spec] = self.adaptor.load(path)
                    self.report.artifacts_loaded += 1
        except Exception as e:  # a truncated, corrupt or incompatible artifact: never trusted
            cache.set_aside(f"{type(e).__name__}: {e}")
            index, artifacts, misses = {}, {}, list(plan)
        counters.num_cache_misses += len(misses)
        if misses and compile_piece is None and not self.config.require_cache_hit:
            raise _WarmLoadFailed
        if misses and self.config.require_cache_hit:
            h, spec = misses[0]
            raise CompileCacheMissError(
                f"Compile cache miss in {cache.entry} with require_cache_hit: {len(misses)} of {len(plan)} "
                f"artifact(s) missing, e.g. {self._name(h, spec)} (piece {first[h].name}, {spec}). "
                f"Run `compiled-llm precompile` with the same settings to fill it."
            )
        if misses:
            logger.info("Compiling %d artifact(s) for %d unique piece(s) into %s.", len(misses), len(first), cache.entry)
        for h, spec in tqdm(misses, desc="Compiling pieces", disable=not (self.progress and misses), dynamic_ncols=True):
            artifact = compile_piece(first[h], spec)
            self.report.inductor_compilations += 1
            name = self._name(h, spec)
            self.adaptor.save(artifact, cache.artifact_path(name))
            self.report.artifacts_saved += 1
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
