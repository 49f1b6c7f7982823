"""Splitting the traced graph around the splitting ops (attention), and hashing pieces by structure.

Every splitting-op call becomes a piece of its own, run eagerly; the runs of nodes between them
become the pieces Inductor compiles. Identical layers give pieces with the same structural hash
(node names ignored), so they compile once and share one artifact.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module


def op_name(target: Any) -> str | None:
    """'namespace::op' for a torch op (packet or overload), None for anything else."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return None


def is_splitting_node(node: fx.Node, splitting_ops: Iterable[str]) -> bool:
    return node.op == "call_function" and op_name(node.target) in set(splitting_ops)


@dataclass
class Piece:
    name: str  # attribute name of the submodule in the split graph
    graph: fx.GraphModule
    is_splitting_op: bool
    index: int


def split_graph(gm: fx.GraphModule, splitting_ops: list[str]) -> tuple[fx.GraphModule, list[Piece]]:
    ops = set(splitting_ops)
    partition: dict[fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, ops):
            current += 1
            partition[node] = current
            current += 1
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in partition \
                and is_splitting_node(node.args[0], ops):
            partition[node] = partition[node.args[0]]  # keep a multi-output op's getitems with it
        else:
            partition[node] = current
    split = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    pieces = []
    for index, (name, module) in enumerate(split.named_children()):
        splitting = any(is_splitting_node(n, ops) for n in module.graph.nodes)
        pieces.append(Piece(name, module, splitting, index))
    return split, pieces


def _describe(value: Any, names: dict[fx.Node, str]) -> Any:
    if isinstance(value, fx.Node):
        return names[value]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, *[_describe(v, names) for v in value]]
    if isinstance(value, dict):
        return {k: _describe(v, names) for k, v in sorted(value.items())}
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, slice):
        return ["slice", _describe(value.start, names), _describe(value.stop, names), _describe(value.step, names)]
    return repr(value)


def _meta_signature(node: fx.Node) -> str:
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{tuple(str(s) for s in value.shape)}{tuple(str(s) for s in value.stride())}"
    return type(value).__name__ if value is not None else ""


def structural_hash(gm: fx.GraphModule) -> str:
    """A hash of the graph's computation with node names replaced by their positions."""
    names: dict[fx.Node, str] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"%{i}"
        target = node.target
        if callable(target):
            target = op_name(target) or getattr(target, "__qualname__", None) or repr(target)
            module = getattr(node.target, "__module__", "")
            target = f"{module}.{target}"
        if node.op == "placeholder":
            target = "input"
        args, kwargs = _describe(node.args, names), _describe(node.kwargs, names)
        lines.append(repr((node.op, target, args, kwargs, _meta_signature(node))))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]
