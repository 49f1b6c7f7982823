"""Inductor's generated module for one artifact, saved beside it so a warm start runs it without
importing Inductor or Dynamo.

A loaded artifact (`CompiledArtifact.load`) is, on a CPU, a generated Python module calling C++
kernels that Inductor built into shared libraries, wrapped by AOTAutograd. Loading it that way
imports `torch._inductor` and `torch._dynamo` first: 3-4 s of a 2-core machine's warm start,
where reading the model takes half a second. So a cold start also saves each artifact's module
source (`save_output_code`) with what its imports from Inductor stand for: the shared library
of every kernel (a file of the entry, loaded the way Inductor loads it), the extern kernels it
calls (torch functions and ops, named by their path), and a few helpers defined here. A warm
start execs that source (`load_output_code`) and calls its `call` as the artifact would.

The saved form is written only after it ran on random inputs and gave exactly the outputs of the
artifact it stands for (same count, shapes, strides, dtypes and values). Anything it cannot
stand for (Triton kernels on a GPU, a Python-only extern kernel, an Inductor import it does not
know, a wrapper that changes the outputs) leaves no saved form, and that artifact loads the
usual way. A start that finds a saved form that does not load falls back the same way.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

FORMAT = 1
# What the generated module imports from Inductor and Dynamo at its top, and what stands for it.
KNOWN_IMPORTS = {"AsyncCompile", "extern_kernels", "align", "run_intermediate_hooks", "maybe_profile"}
# Ops that talk to other ranks (this package's tensor-parallel all-reduce, torch's collectives).
COLLECTIVES = ("tp_all_reduce", "torch.ops._c10d_functional.", "torch.ops.c10d.")
ALIGN_BYTES = 64  # torch._inductor.codegen.memory_planning.ALIGN_BYTES (checked at save)


class NotSavable(Exception):
    """The generated module uses something its saved form cannot stand for."""


def output_code_rel(artifact_rel: str) -> str:
    return artifact_rel.removesuffix(".bin") + ".code.json"


def kernel_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """One C++ kernel's identity: the arguments of its `cpp_pybinding` call (types and source)."""
    return hashlib.sha256(json.dumps([list(args), sorted(kwargs.items())], default=list).encode()).hexdigest()


# ---- saving (a cold start, Inductor imported) ---------------------------------------------------
@contextmanager
def recording_output_modules() -> Iterator[list[types.ModuleType]]:
    """The generated modules Inductor loads while the block runs (compiling or loading artifacts)."""
    from torch._inductor.codecache import PyCodeCache

    loaded: list[types.ModuleType] = []
    original = PyCodeCache.__dict__["load_by_key_path"]

    def load_by_key_path(cls: type, *args: Any, **kwargs: Any) -> types.ModuleType:
        module = original.__func__(cls, *args, **kwargs)
        loaded.append(module)
        return module

    PyCodeCache.load_by_key_path = classmethod(load_by_key_path)
    try:
        yield loaded
    finally:
        PyCodeCache.load_by_key_path = original


def _is_inductor_module(name: str | None) -> bool:
    return bool(name) and (name == "torch._inductor" or name.startswith(("torch._inductor.", "torch._dynamo")))


def _torch_path(fn: Any) -> str:
    """A path from `torch` that names `fn` again in a process that never imported Inductor."""
    if isinstance(fn, torch._ops.OpOverload):
        namespace, name = fn.name().split("::")
        op, _, overload = name.partition(".")
        path = f"torch.ops.{namespace}.{op}.{overload or 'default'}"
    elif isinstance(fn, torch._ops.OpOverloadPacket):
        namespace, op = fn._qualified_op_name.split("::")
        path = f"torch.ops.{namespace}.{op}"
    elif getattr(fn, "__module__", None) == "torch" and getattr(torch, fn.__name__, None) is fn:
        path = f"torch.{fn.__name__}"
    else:
        raise NotSavable(f"extern kernel {fn!r} is not a torch function or op")
    if path.startswith("torch.ops.inductor."):
        raise NotSavable(f"extern kernel {path} is registered by Inductor")
    return path


def _resolve(path: str) -> Any:
    value: Any = torch
    for part in path.split(".")[1:]:
        value = getattr(value, part)
    return value


def _literal_call_args(call: ast.Call) -> tuple[tuple[Any, ...], dict[str, Any]]:
    try:
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
    except ValueError:
        raise NotSavable("a kernel built from non-literal arguments") from None
    if len(kwargs) != len(call.keywords):
        raise NotSavable("a kernel built with **kwargs")
    return args, kwargs


def describe(module: types.ModuleType, roots: list[Path]) -> dict[str, Any]:
    """The saved form of a loaded generated module: its source with the top-level Inductor and
    Dynamo imports taken out, and what they stand for. Kernel libraries are named relative to
    whichever of `roots` (the entry, its staged copy) holds them."""
    from torch._inductor.codegen.memory_planning import _align

    if any(_align(n) != _shim_align(n) for n in (0, 1, 63, 64, 65, 4097)):
        raise NotSavable("Inductor's buffer alignment is not the one assumed here")
    source = Path(module.__file__).read_text()
    if any(name in source for name in COLLECTIVES):
        # Its check would run the collective on each rank on its own, and a rank whose check ends
        # early (any refusal) would leave the others waiting in it: a tensor-parallel piece keeps
        # Inductor's loader.
        raise NotSavable("calls a collective")
    tree = ast.parse(source)
    drop: list[tuple[int, int]] = []
    for node in tree.body:
        if isinstance(node, ast.Import) and any(_is_inductor_module(a.name) for a in node.names):
            raise NotSavable(f"imports {', '.join(a.name for a in node.names)}")
        if isinstance(node, ast.ImportFrom) and _is_inductor_module(node.module):
            names = {a.asname or a.name for a in node.names}
            if not names <= KNOWN_IMPORTS:
                raise NotSavable(f"imports {sorted(names - KNOWN_IMPORTS)} from {node.module}")
            drop.append((node.lineno, node.end_lineno or node.lineno))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "async_compile"
                and node.attr not in ("cpp_pybinding", "wait")):
            raise NotSavable(f"builds kernels with async_compile.{node.attr}")
    kernels: dict[str, dict[str, str]] = {}
    for node in tree.body:
        call = node.value if isinstance(node, ast.Assign) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "cpp_pybinding"):
            continue
        if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            raise NotSavable("a kernel assigned to something other than a name")
        library = getattr(getattr(module, node.targets[0].id, None), "__self__", None)
        file = getattr(library, "__file__", None) or ""
        if not file.endswith(".so"):
            raise NotSavable(f"kernel {node.targets[0].id} is not from a shared library")
        kernels[kernel_key(*_literal_call_args(call))] = {"module": library.__name__, "file": _relative(file, roots)}
    extern = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "extern_kernels":
            extern[node.attr] = _torch_path(getattr(module.extern_kernels, node.attr))
    lines = source.splitlines(keepends=True)
    for first, last in drop:
        for i in range(first - 1, last):
            lines[i] = "\n"  # keep the line numbers of the generated source
    return {"format": FORMAT, "torch": torch.__version__, "source": "".join(lines),
            "kernels": kernels, "extern_kernels": extern}


def _relative(file: str, roots: list[Path]) -> str:
    """A kernel library's path inside the entry (or its staged copy)."""
    for root in roots:
        try:
            return Path(file).resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            continue
    raise NotSavable(f"kernel library {file} is outside the cache entry")


def output_difference(expected: Any, got: Any) -> str | None:
    """How two calls' outputs differ (count, shape, stride, dtype, values), or None: equal. A
    bare tensor counts as one output (a fresh artifact of a one-output piece returns one)."""
    expected, got = ([x] if isinstance(x, torch.Tensor) else list(x) for x in (expected, got))
    if len(expected) != len(got):
        return f"{len(got)} outputs where the artifact gives {len(expected)}"
    for i, (a, b) in enumerate(zip(expected, got)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i} is {b!r} where the artifact gives {a!r}"
            continue
        if (a.shape, a.stride(), a.dtype) != (b.shape, b.stride(), b.dtype):
            layout = [(tuple(t.shape), t.stride(), t.dtype) for t in (b, a)]
            return f"output {i} is {layout[0]} where the artifact's is {layout[1]}"
        if not torch.equal(a, b):
            return f"output {i} differs in value"
    return None


def random_like(x: torch.Tensor) -> torch.Tensor:
    """Fill `x` with values every kernel accepts and that stay finite: normal floats, zeros for
    integer tensors (valid indices), bytes below 60 for packed weights (their float16 scales
    then stay below 1, never infinite or NaN)."""
    if x.is_floating_point():
        return x.normal_()
    if x.dtype in (torch.uint8, torch.int8):
        return x.random_(0, 60)
    return x.zero_()


# ---- loading (a warm start, Inductor not imported) ----------------------------------------------
def _shim_align(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) & -ALIGN_BYTES


def _not_served(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a saved Inductor module called a debugging hook it was saved without")


@dataclass
class _AsyncCompile:
    """Stands for Inductor's AsyncCompile in a saved module: every C++ kernel is already built."""

    libraries: dict[str, Callable[..., Any]]

    def cpp_pybinding(self, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        return self.libraries[kernel_key(args, kwargs)]

    def wait(self, scope: dict[str, Any]) -> None:
        pass


def _load_library(module_name: str, file: Path) -> Callable[..., Any]:
    """A kernel library loaded as Inductor loads it (the same module name, so a process that
    built it shares it)."""
    library = sys.modules.get(module_name)
    if library is None:
        os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
            torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {file}")
        library = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(library)
        sys.modules[module_name] = library
    return library.kernel


def load_output_code(saved: dict[str, Any], root: Path, verified: set[str] | None = None) -> Callable[..., Any]:
    """The `call` of a saved module, its kernels loaded from `root` (only files in `verified`,
    when given: the files a staged copy of the entry checked)."""
    if saved.get("format") != FORMAT or saved.get("torch") != torch.__version__:
        raise ValueError("saved by another version")
    libraries = {}
    for key, where in saved["kernels"].items():
        if verified is not None and where["file"] not in verified:
            raise ValueError(f"{where['file']} is not a checked file of the entry")
        libraries[key] = _load_library(where["module"], root / where["file"])
    namespace: dict[str, Any] = {
        "__name__": "compiled_llm_saved_output_code",
        "AsyncCompile": lambda: _AsyncCompile(libraries),
        "extern_kernels": types.SimpleNamespace(**{n: _resolve(p) for n, p in saved["extern_kernels"].items()}),
        "align": _shim_align,
        "run_intermediate_hooks": _not_served,
        "maybe_profile": _not_served,
    }
    exec(compile(saved["source"], "<saved inductor output code>", "exec"), namespace)
    call = namespace["call"]

    def run(*args: Any) -> Any:
        return call(list(args))

    return run
