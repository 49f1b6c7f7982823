"""The torch.compile backend: split the traced graph around the splitting ops, then compile (or
load from the compile cache) every other piece for each compile range and size.

Two paths, each its own function. A warm start (`CompilerBackend.load_saved`) rebuilds the
split graph from the cache entry and loads every artifact (`CompilerManager.load`): no Dynamo,
no Inductor. A cold start is Dynamo calling the backend (`CompilerBackend.__call__`) once with
its graph; it runs the compiler passes over it (compilation/pass_manager.py), splits it, loads
what the entry holds and compiles the rest (`CompilerManager.compile`), then saves the traced
(fused) graph. Everything happens at start-up: afterwards the split graph runs
compiled pieces and eager splitting ops, and nothing compiles lazily.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from tqdm.auto import tqdm

from compiled_llm.compilation import traced_graph
from compiled_llm.compilation.compile_cache import CompileCache, CompileCacheMissError, Damage
from compiled_llm.compilation.config import CompilationConfig, CUDAGraphMode
from compiled_llm.compilation.counters import counters
from compiled_llm.compilation.cuda_graph import CUDAGraphWrapper
from compiled_llm.compilation.inductor_adaptor import CompiledPiece, InductorAdaptor, graph_returns_tuple, static_inputs
from compiled_llm.compilation.output_code import (
    describe,
    load_output_code,
    output_code_rel,
    output_difference,
    random_like,
    recording_output_modules,
)
from compiled_llm.compilation.partition import split_graph, structural_hash
from compiled_llm.compilation.pass_manager import PassManager
from compiled_llm.compilation.piecewise_backend import PiecewiseBackend, ShapeSpec, shape_specs
from compiled_llm.compilation.traced_graph import GRAPH_FILE, META_FILE, PieceMeta, TracedGraph
from compiled_llm.logger import init_logger
from compiled_llm.utils import atomic_write_bytes

if TYPE_CHECKING:
    import sympy  # not at run time: 0.6 s of a warm start, which never needs it

logger = init_logger(__name__)


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
    import sympy

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
        sized = isinstance(a, torch.Tensor) and a.dim() and isinstance(a.shape[0], torch.SymInt)
        if sized and a.shape[0].node.expr == symbol:
            return i, False
    raise RuntimeError("a compiled piece has no input sized by the token dimension")


class CompilerManager:
    """The artifacts of one start, one per unique (piece, shape spec): `load` takes them from a
    verified copy of the cache entry, `compile` loads what the entry holds and compiles the rest
    into it. Loading is kept apart from compiling, as vLLM's `CompilerManager` does."""

    def __init__(
        self, cache: CompileCache, adaptor: InductorAdaptor, specs: list[ShapeSpec], require_cache_hit: bool,
        progress: bool,
    ) -> None:
        self.cache = cache
        self.adaptor = adaptor
        self.specs = specs
        self.require_cache_hit = require_cache_hit
        self.progress = progress
        # Loaded artifacts; they outlive a warm load that fell back to the cold path.
        self.artifacts: dict[tuple[str, ShapeSpec], Any] = {}
        # The generated module Inductor loaded for each artifact (cold path), for `save_output_code`.
        self.output_modules: dict[tuple[str, ShapeSpec], types.ModuleType] = {}
        self.resave: set[tuple[str, ShapeSpec]] = set()  # saved modules that did not load while filling

    @staticmethod
    def name(piece_hash: str, spec: ShapeSpec) -> str:
        return f"{piece_hash}-{spec.tag}"

    def plan(self, metas: list[PieceMeta]) -> dict[tuple[str, ShapeSpec], PieceMeta]:
        """Every (unique piece, spec) to load or compile, with the first piece of that structure."""
        first: dict[str, PieceMeta] = {}
        for meta in metas:
            first.setdefault(meta.piece_hash, meta)
        return {(h, spec): meta for h, meta in first.items() for spec in self.specs}

    def missing(self, metas: list[PieceMeta]) -> list[tuple[str, ShapeSpec]]:
        return [k for k in self.plan(metas) if k not in self.artifacts and not self.cache.has(self._rel(k))]

    def _rel(self, key: tuple[str, ShapeSpec]) -> str:
        return self.cache.artifact_rel(self.name(*key))

    def load(self, metas: list[PieceMeta], folder: Path, verified: set[str] | None = None) -> Damage | None:
        """Load every artifact of `metas` from `folder` (a verified copy of the entry, whose checked
        files are `verified`); the first one that does not load is returned."""
        for key in self.plan(metas):
            damage = self._load_one(key, folder, verified)
            if damage is not None:
                return damage
        return None

    def _load_one(self, key: tuple[str, ShapeSpec], folder: Path, verified: set[str] | None = None) -> Damage | None:
        """Load one artifact: its saved module where the entry has one (no Inductor import), else
        the artifact itself. Content that does not load, checksum right or not, is never trusted."""
        if key in self.artifacts:
            return None
        code = output_code_rel(self._rel(key))
        if (folder / code).is_file() and (verified is None or code in verified):
            try:
                self.artifacts[key] = load_output_code(json.loads((folder / code).read_bytes()), folder, verified)
                counters.num_artifacts_loaded += 1
                return None
            except Exception as e:
                if verified is not None:  # a warm start's checked copy: damage, never half-trusted
                    return Damage(code, f"does not load ({type(e).__name__}: {e})")
                # Filling the entry: the artifact may still load (Inductor rebuilds a kernel library
                # that was set aside), and its module is then saved again.
                logger.info("Saved Inductor module %s does not load (%s: %s); loading its artifact.",
                            code, type(e).__name__, e)
                self.resave.add(key)
        try:
            with recording_output_modules() as modules:
                self.artifacts[key] = self.adaptor.load(folder / self._rel(key))
        except Exception as e:  # checksum right, content unusable (another build): never trusted
            return Damage(self._rel(key), f"does not load ({type(e).__name__}: {e})")
        self._remember_output_module(key, modules)
        return None

    def _remember_output_module(self, key: tuple[str, ShapeSpec], modules: list[types.ModuleType]) -> None:
        generated = [m for m in modules if hasattr(m, "call")]
        if len(generated) == 1:
            self.output_modules[key] = generated[0]

    def save_output_code(self, metas: list[PieceMeta], piece_inputs: dict[str, tuple[Any, ...]],
                         symbol: sympy.Symbol | None) -> None:
        """Save each artifact's generated module for warm starts without Inductor (output_code.py),
        once it gave exactly the artifact's outputs on random inputs of each size checked."""
        roots = [self.cache.entry] + ([self.cache.staged_folder] if self.cache.staged_folder else [])
        for key, meta in self.plan(metas).items():
            rel = output_code_rel(self._rel(key))
            module = self.output_modules.get(key)
            if module is None or (self.cache.has(rel) and key not in self.resave):
                continue
            try:
                code = describe(module, roots)
                fast = load_output_code(code, self.cache.entry)
                spec = key[1]
                for size in sorted({spec.lo, min(spec.hi, max(spec.lo, 3))}):
                    with torch._subclasses.fake_tensor.unset_fake_temporarily():
                        args = [random_like(x) if isinstance(x, torch.Tensor) else x
                                for x in static_inputs(list(piece_inputs[meta.name]), symbol, size)]
                        difference = output_difference(self.artifacts[key](*args), fast(*args))
                    if difference is not None:
                        raise ValueError(f"at {size} tokens its {difference}")
            except Exception as e:
                logger.info("Piece %s (%s) keeps Inductor's loader for warm starts: %s", meta.name, key[1], e)
                continue
            atomic_write_bytes(self.cache.entry / rel, json.dumps(code).encode())

    def refuse_misses(self, metas: list[PieceMeta], misses: list[tuple[str, ShapeSpec]]) -> None:
        """A start that must not compile (strict, or from a read-only cache) fails on a miss,
        naming the first missing artifact."""
        plan = self.plan(metas)
        if misses and self.require_cache_hit:
            h, spec = misses[0]
            raise CompileCacheMissError(
                f"Compile cache miss in {self.cache.entry} with require_cache_hit: {len(misses)} of {len(plan)} "
                f"artifact(s) missing, e.g. {self.name(h, spec)} (piece {plan[h, spec].name}, {spec}). "
                f"Run `compiled-llm precompile` with the same settings to fill it."
            )
        if self.cache.read_only:
            what = f"{len(misses)} of {len(plan)} artifact(s) missing" if misses else "it has no saved graph"
            raise CompileCacheMissError(
                f"Compile cache entry {self.cache.entry} is read-only and cannot serve this start: {what}. Run "
                f"`compiled-llm precompile` with the same settings where the cache is writable to fill it."
            )

    def compile(self, metas: list[PieceMeta], compile_piece: Any) -> dict[tuple[str, ShapeSpec], Any]:
        """Load every artifact the entry holds and compile, save and index the rest."""
        cache = self.cache
        plan = self.plan(metas)
        misses = self.missing(metas)
        counters.num_cache_misses += len(misses)
        self.refuse_misses(metas, misses)
        cache.prepare()  # sets aside what fails its checksum: look again
        for key in plan:
            if key in self.artifacts or key in misses:
                continue
            if not cache.has(self._rel(key)):
                misses.append(key)
                continue
            damage = self._load_one(key, cache.entry)
            if damage is not None:
                if self.require_cache_hit:
                    raise_refusal(cache, [damage], "with require_cache_hit")
                cache.set_aside([damage])
                misses.append(key)
        if misses:
            logger.info("Compiling %d artifact(s) for %d unique piece(s) into %s.",
                        len(misses), len({h for h, _ in plan}), cache.entry)
        for key in tqdm(misses, desc="Compiling pieces", disable=not (self.progress and misses), dynamic_ncols=True):
            with recording_output_modules() as modules:
                artifact = compile_piece(plan[key], key[1])
            self._remember_output_module(key, modules)
            self.adaptor.save(artifact, cache.entry / self._rel(key))
            cache.commit()  # the artifact and the files Inductor wrote for it
            self.artifacts[key] = artifact
        return {key: self.artifacts[key] for key in plan}


def raise_refusal(cache: CompileCache, damages: list[Damage], why: str) -> None:
    more = f" (and {len(damages) - 1} more damaged file(s))" if len(damages) > 1 else ""
    raise CompileCacheMissError(
        f"Compile cache entry {cache.entry} cannot serve a start {why}: {damages[0]}{more}. Run "
        f"`compiled-llm precompile` with the same settings to rebuild it."
    )


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
        self.specs = shape_specs(config.compile_ranges, config.compile_sizes)
        self.adaptor = InductorAdaptor(config.inductor_options)
        self.manager = CompilerManager(cache, self.adaptor, self.specs, config.require_cache_hit, progress)
        self.named_tensors = {id(t): n for n, t in model.named_parameters(remove_duplicate=False)}
        self.named_tensors.update({id(t): n for n, t in model.named_buffers(remove_duplicate=False)})
        self.inputs: Sequence[torch.Tensor] = ()  # the forward's inputs of the tracing call
        self.graphs_seen = 0
        self.piece_backends: list[PiecewiseBackend] = []
        self.split: torch.nn.Module | None = None  # a GraphModule, or loaded: a SavedGraphModule
        self.traced: TracedGraph | None = None

    # ---- warm start: the saved graph and its artifacts ------------------------------------------
    def load_saved(self) -> TracedGraph | None:
        """Rebuild from the cache entry without Dynamo or Inductor, loading only from a copy whose
        every file matched the index. None when the entry cannot serve this start (nothing saved
        yet; missing or damaged files, which are set aside): Dynamo then traces and `__call__`
        compiles what is missing. A damaged entry is an error in strict mode or when read-only."""
        stage = self.cache.stage()
        if stage.damages:
            return self._refuse_or_set_aside(stage.damages)
        if not stage.files:
            return None
        try:
            meta = traced_graph.load_meta(stage.folder)
        except Exception as e:
            return self._refuse_or_set_aside([Damage(META_FILE, f"is unreadable ({type(e).__name__}: {e})")])
        if meta is None:
            return None
        bindings, pieces = meta
        missing = self.manager.missing(pieces)
        if missing:
            self.manager.refuse_misses(pieces, missing)
            return None
        try:
            graph = traced_graph.load_graph(stage.folder)
        except Exception as e:
            return self._refuse_or_set_aside([Damage(GRAPH_FILE, f"is unreadable ({type(e).__name__}: {e})")])
        self.cache.use_stage_for_inductor()
        damage = self.manager.load(pieces, stage.folder, stage.files)
        if damage is not None:
            return self._refuse_or_set_aside([damage])
        self._install(graph, pieces, self.manager.artifacts)
        self.traced = TracedGraph(graph, bindings, pieces)
        return self.traced

    def _refuse_or_set_aside(self, damages: list[Damage]) -> None:
        """Damaged files fail a strict start or a read-only cache; otherwise they are set aside
        and the cold path rebuilds them."""
        if self.config.require_cache_hit:
            raise_refusal(self.cache, damages, "with require_cache_hit")
        if self.cache.read_only:
            raise_refusal(self.cache, damages, "from a read-only cache")
        if any(d.path in (GRAPH_FILE, META_FILE) for d in damages):
            logger.warning("Saved graph in %s is unreadable; tracing it again.", self.cache.entry)
        self.cache.set_aside(damages)
        return None

    # ---- cold start: Dynamo hands us its graph --------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        counters.num_graphs_traced += 1
        self.graphs_seen += 1
        if self.graphs_seen > 1:
            counters.num_recompiles += 1
            logger.error("Dynamo traced the model a second time (a recompile): a bug in the traced code's guards.")
        bindings = traced_graph.bind_placeholders(example_inputs, self.named_tensors, self.inputs)
        counters.num_fused_sites += sum(PassManager(self.config.passes)(gm).values())
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

        artifacts = self.manager.compile(metas, compile_piece)
        self.manager.save_output_code(metas, inputs, symbol)
        self.traced = TracedGraph(traced_graph.strip_graph(split, [m.name for m in metas]), bindings, metas)
        traced_graph.save(self.cache.entry, self.traced)
        self.cache.commit()
        if self.cache.signing_key is not None:
            logger.info("Signed compile cache entry %s (%s).", self.cache.entry, "manifest.sig")
        self._install(split, metas, artifacts)
        return split

    # ---- shared ---------------------------------------------------------------------------------
    def _install(
        self, split: torch.nn.Module, metas: list[PieceMeta], artifacts: dict[tuple[str, ShapeSpec], Any]
    ) -> None:
        piecewise = self.config.cudagraph_mode.has_piecewise_cudagraphs()
        for meta in metas:
            runnables = {
                spec: CompiledPiece(artifacts[meta.piece_hash, spec], meta.returns_tuple) for spec in self.specs
            }
            backend = PiecewiseBackend(meta.name, (meta.token_index, meta.token_is_int), runnables)
            del split._modules[meta.name]
            # Under piecewise CUDA graphs each compiled piece is captured and replayed by itself.
            runnable = CUDAGraphWrapper(backend, CUDAGraphMode.PIECEWISE, name=meta.name) if piecewise else backend
            setattr(split, meta.name, runnable)
            self.piece_backends.append(backend)
        self.split = split
        counters.num_pieces += len(metas)
        counters.num_unique_pieces += len({m.piece_hash for m in metas})

    @staticmethod
    def _range_hint(spec: ShapeSpec) -> int | None:
        """Tune a symbolic range for its upper end, capped so that big ranges tune for batched steps."""
        if spec.static:
            return None
        return max(2, min(spec.hi, 512))
