"""Compiling one graph piece with Inductor (`standalone_compile`), saving and loading the artifact.

Inductor is imported here, when a piece is first compiled or loaded this way, not when the
module is: a warm start that runs saved modules (output_code.py) never imports it (3-4 s).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.fx as fx

from compiled_llm.compilation import inductor_settings
from compiled_llm.compilation.counters import counters

if TYPE_CHECKING:
    import sympy  # not at run time: 0.6 s of a warm start, which never needs it


def graph_returns_tuple(gm: fx.GraphModule) -> bool:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


class CompiledPiece:
    """A compiled artifact with the piece's own return convention restored.

    A piece that returns one value gets a bare tensor from a fresh artifact but a one-element
    list from a loaded one; unwrap only that case.
    """

    def __init__(self, artifact: Callable[..., Any], returns_tuple: bool) -> None:
        self.artifact = artifact
        self.returns_tuple = returns_tuple

    def __call__(self, *args: Any) -> Any:
        out = self.artifact(*args)
        if not self.returns_tuple and isinstance(out, (list, tuple)):
            return out[0]
        return out


@contextmanager
def _size_hint(shape_env: Any, symbol: sympy.Symbol | None, hint: int | None) -> Iterator[None]:
    """Compile a symbolic range tuned for `hint` (Inductor picks kernels by the size hint)."""
    if shape_env is None or symbol is None or hint is None:
        yield
        return
    # torch >= 2.12 renamed the table; older releases (the GPU image's) have only var_to_val.
    hints = getattr(shape_env, "backed_var_to_val", None)
    if hints is None:
        hints = shape_env.var_to_val
    if symbol not in hints:
        yield
        return
    import sympy

    previous = hints[symbol]
    hints[symbol] = sympy.Integer(hint)
    try:
        yield
    finally:
        hints[symbol] = previous


def static_inputs(example_inputs: list[Any], symbol: sympy.Symbol, size: int) -> list[Any]:
    """Concrete-shaped stand-ins for a static compile: the token dimension set to `size`."""

    def concrete(x: Any) -> int:
        if isinstance(x, torch.SymInt):
            expr = x.node.expr
            return int(expr.subs(symbol, size)) if expr.free_symbols else int(expr)
        return int(x)

    out: list[Any] = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            shape = [concrete(s) for s in x.shape]
            stride = [concrete(s) for s in x.stride()]
            out.append(torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device))
        elif isinstance(x, torch.SymInt):
            out.append(concrete(x))
        else:
            out.append(x)
    return out


class InductorAdaptor:
    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def compile(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        symbol: sympy.Symbol | None,
        shape_env: Any,
        size: int | None = None,
        hint: int | None = None,
    ) -> Any:
        """Compile for a static `size`, or symbolically (tuned for `hint`) when size is None."""
        from torch._inductor import standalone_compile

        inductor_settings.apply()
        counters.num_inductor_compilations += 1
        options = {"config_patches": self.options}
        if size is not None:
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                inputs = static_inputs(example_inputs, symbol, size)
            return standalone_compile(graph, inputs, dynamic_shapes="from_example_inputs", options=options)
        with _size_hint(shape_env, symbol, hint):
            return standalone_compile(graph, example_inputs, dynamic_shapes="from_tracing_context", options=options)

    @staticmethod
    def save(artifact: Any, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)  # save() wants to create the file itself
        try:
            artifact.save(path=tmp, format="binary")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        counters.num_artifacts_saved += 1

    @staticmethod
    def load(path: Path) -> Any:
        from torch._inductor import CompiledArtifact

        inductor_settings.apply()
        artifact = CompiledArtifact.load(path=str(path), format="binary")
        counters.num_artifacts_loaded += 1
        return artifact
