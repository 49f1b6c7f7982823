"""The traced graph saved beside its artifacts, so a warm start needs no Dynamo at all.

Dynamo's graph takes a flat list of placeholders: model parameters and buffers, the forward's
inputs, and symbolic sizes. At the cold start we record what each placeholder is bound to (a
named model tensor, an input, or an input's size) and save a copy of the graph without its
tracing metadata; with the per-piece facts the runtime needs (structural hash, where the token
count is read, the return convention) a warm start rebuilds the split graph and loads the
artifacts directly. Every start, cold or warm, then calls the split graph directly: no guard
is evaluated per call and nothing can recompile.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx

from compiled_llm.utils import atomic_write_bytes

GRAPH_FILE = "graph.pkl"
META_FILE = "graph.json"
FORMAT_VERSION = 1


@dataclass
class Binding:
    kind: str  # "tensor" (a named model parameter or buffer), "input", or "size" (of an input)
    name: str = ""
    input: int = 0
    dim: int = 0


@dataclass
class PieceMeta:
    name: str
    piece_hash: str
    token_index: int
    token_is_int: bool
    returns_tuple: bool


@dataclass
class TracedGraph:
    graph: torch.nn.Module  # the split graph (a GraphModule, or loaded: SavedGraphModule), pieces not installed
    bindings: list[Binding]
    pieces: list[PieceMeta]


def bind_placeholders(
    example_inputs: Sequence[Any], named_tensors: dict[int, str], inputs: Sequence[torch.Tensor]
) -> list[Binding]:
    """What each of Dynamo's placeholders is, from the example values it was traced with."""
    bindings = []
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            hint = int(value.node.hint) if value.node.hint is not None else None
            match = next(((i, d) for i, x in enumerate(inputs) for d in range(x.dim()) if x.shape[d] == hint), None)
            if match is None:
                raise RuntimeError(f"cannot tell which input size the symbolic placeholder {value} is")
            bindings.append(Binding("size", input=match[0], dim=match[1]))
        elif any(value is x for x in inputs):
            bindings.append(Binding("input", input=next(i for i, x in enumerate(inputs) if value is x)))
        elif isinstance(value, torch.Tensor) and id(value) in named_tensors:
            bindings.append(Binding("tensor", name=named_tensors[id(value)]))
        else:
            raise RuntimeError(f"a traced placeholder is neither an input nor a model tensor: {type(value).__name__}")
    return bindings


def strip_graph(gm: fx.GraphModule, compiled_pieces: Sequence[str] = ()) -> fx.GraphModule:
    """A copy of `gm` (and of its submodule graphs) without tracing metadata: picklable.

    The split graph is saved as split: splitting again without the metadata would give the
    pieces other arguments (split_module adds size arguments from it). The graphs of
    `compiled_pieces` are left out (an empty module stands in): their compiled artifacts replace
    them at load, and unpickling a graph means generating its code again.
    """
    root = torch.nn.Module()
    for name, child in gm.named_children():
        if name in compiled_pieces:
            child = torch.nn.Module()
        setattr(root, name, strip_graph(child) if isinstance(child, fx.GraphModule) else child)
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        node.meta = {}
    return fx.GraphModule(root, graph)


def save(entry: Path, traced: TracedGraph) -> None:
    """`traced.graph` must be stripped (`strip_graph`)."""
    atomic_write_bytes(entry / GRAPH_FILE, pickle.dumps(traced.graph))
    meta = {
        "version": FORMAT_VERSION,
        "bindings": [asdict(b) for b in traced.bindings],
        "pieces": [asdict(p) for p in traced.pieces],
    }
    atomic_write_bytes(entry / META_FILE, json.dumps(meta, indent=1).encode())


def load_meta(folder: Path) -> tuple[list[Binding], list[PieceMeta]] | None:
    """The saved graph's bindings and pieces, or None when there is no saved graph. Raises if
    it cannot be read (damaged, or another format version)."""
    try:
        raw = (folder / META_FILE).read_bytes()
    except FileNotFoundError:
        return None
    meta = json.loads(raw)
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"format version {meta.get('version')}, this one reads {FORMAT_VERSION}")
    return [Binding(**b) for b in meta["bindings"]], [PieceMeta(**p) for p in meta["pieces"]]


class SavedGraphModule(torch.nn.Module):
    """A graph module of the saved graph, run from the code torch.fx pickled for it as it stands.

    torch.fx unpickles a GraphModule by tracing that code again to rebuild its Graph, then
    generating and compiling the code a second time: for the split graph and its 30 attention
    modules 0.08-0.14 s of a warm start on a 2-core machine. A warm start only calls the split
    graph (its compiled pieces installed in it), never reads a Graph, so each module is rebuilt
    here from the same two things torch's own loader receives, the module's attributes and its
    code, and keeps no Graph (`graph` rebuilds one, as torch.fx would, for whoever inspects it)."""

    _import_block: str

    @property
    def graph(self) -> fx.Graph:
        body = {**self.__dict__, "_modules": dict(self._modules)}
        for name, value in self.__dict__.items():  # installed compiled pieces: leaves, as when saved
            if name.startswith("submod_") and callable(value) and not isinstance(value, torch.nn.Module):
                del body[name]
                body["_modules"][name] = torch.nn.Module()
        return fx.graph_module.reduce_graph_module(body, self._import_block).graph


def _saved_graph_module(body: dict[str, Any], import_block: str) -> torch.nn.Module:
    """`torch.fx.graph_module.reduce_graph_module`'s arguments (its pickled form) as a module."""
    code = body.get("_code") or body["code"]
    namespace: dict[str, Any] = {}
    exec(compile(f"{import_block}\n{code}", "<saved graph module>", "exec"), namespace)  # noqa: S102 - verified entry
    cls = type(body.get("_graphmodule_cls_name", "GraphModule"), (SavedGraphModule,),
               {"forward": namespace["forward"]})
    module = cls()
    module.__dict__.update(body)
    module._import_block = import_block
    return module


class _SavedGraphUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.fx.graph_module", "reduce_graph_module"):
            return _saved_graph_module
        return super().find_class(module, name)


def load_graph(folder: Path) -> torch.nn.Module:
    """Unpickles the saved graph: only ever from a verified copy of the entry (it is code). Its
    graph modules come back as `SavedGraphModule`s: the split graph's call, without its Graph."""
    with open(folder / GRAPH_FILE, "rb") as f:
        return _SavedGraphUnpickler(f).load()


class DirectCall:
    """Calls the split graph with its placeholders filled from the model and the inputs."""

    def __init__(self, split: torch.nn.Module, bindings: list[Binding], model: torch.nn.Module) -> None:
        self.split = split
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(dict(model.named_buffers(remove_duplicate=False)))
        self.template: list[Any] = []
        self.inputs: list[tuple[int, int]] = []  # (placeholder position, input index)
        self.sizes: list[tuple[int, int, int]] = []  # (placeholder position, input index, dim)
        for position, b in enumerate(bindings):
            if b.kind == "tensor":
                if b.name not in tensors:
                    raise RuntimeError(f"the saved graph needs model tensor {b.name!r}, which this model lacks")
                self.template.append(tensors[b.name])
            else:
                self.template.append(None)
                if b.kind == "input":
                    self.inputs.append((position, b.input))
                else:
                    self.sizes.append((position, b.input, b.dim))

    def __call__(self, *inputs: torch.Tensor) -> Any:
        args = list(self.template)
        for position, index in self.inputs:
            args[position] = inputs[index]
        for position, index, dim in self.sizes:
            args[position] = inputs[index].shape[dim]
        out = self.split(*args)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
