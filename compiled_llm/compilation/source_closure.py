"""Which of the package's source files can shape compiled code: an import closure read from source.

The compile cache key hashes source files so that an edit to the code Dynamo traces (or to the code
that builds what it traces) gives a new entry. Hashing every file of the package would also make an
edit to a tool parser or to the CLI's help text invalidate every cache. This reads the `import`
statements of a set of root packages (every statement, the lazy ones inside functions included) and
follows them through the package: the closure is every file the graph-building code can reach, so
an edit outside it cannot change what it traces. No module is imported to find it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator


def import_statements(text: str) -> Iterator[str]:
    """The import statements of a source file, each as one line of text. Parsing only these (not the
    whole file) keeps the key quick to compute at every start. A docstring line that reads like an
    import may come along; where it does not parse, the caller reads the whole file's tree instead."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not (line.startswith("import ") or (line.startswith("from ") and " import" in line)):
            continue
        while (line.count("(") > line.count(")") or line.endswith("\\")) and i < len(lines):
            line = line.rstrip("\\") + " " + lines[i].strip()
            i += 1
        yield line


def _module_names(text: str, package: str) -> set[str]:
    """Every module name an import statement of `text` may bind (for `from a import b`: a and a.b)."""
    names: set[str] = set()
    try:  # the statements parsed together: one compile per file (one each took 0.07 s of a start)
        nodes = ast.parse("\n".join(import_statements(text))).body
    except SyntaxError:  # prose in a docstring, which may have swallowed real imports after it:
        tree = ast.parse(text)  # read this file's imports from its whole syntax tree instead
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: strip level - 1 parts from the importing package
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


class SourceTree:
    """Maps module names to files for packages whose folders may lie anywhere."""

    def __init__(self, packages: dict[str, Path]) -> None:
        # Longest name first, so that `compiled_llm.compilation` wins over `compiled_llm`.
        self.packages = sorted(packages.items(), key=lambda item: -len(item[0]))

    def file_of(self, module: str) -> Path | None:
        for name, folder in self.packages:
            if module == name or module.startswith(name + "."):
                rest = module[len(name) + 1:].split(".") if module != name else []
                path = folder.joinpath(*rest)
                if path.with_suffix(".py").is_file():
                    return path.with_suffix(".py")
                if (path / "__init__.py").is_file():
                    return path / "__init__.py"
                return None
        return None

    def module_of(self, path: Path) -> str:
        for name, folder in self.packages:
            if folder == path.parent or folder in path.parents:
                parts = [name, *path.relative_to(folder).with_suffix("").parts]
                return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        raise ValueError(f"{path} is not in any of the packages")

    def imports_of(self, path: Path) -> set[Path]:
        """The package files that `path` imports (for each name, the deepest module that exists)."""
        module = self.module_of(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for name in _module_names(path.read_text(encoding="utf-8"), package):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                target = self.file_of(".".join(parts[:i]))
                if target is not None:
                    found.add(target)
                    break
        return found


def import_closure(tree: SourceTree, roots: list[Path], leaves: set[Path] = frozenset()) -> list[Path]:
    """Every file of `roots` (folders, searched recursively, or files) and every package file they
    import, transitively. `leaves` are not entered: a package's top `__init__.py`, whose imports
    re-export the public API rather than shape anything the roots run."""
    todo = [f for root in roots for f in (sorted(root.rglob("*.py")) if root.is_dir() else [root])]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen or path in leaves:
            continue
        seen.add(path)
        todo.extend(tree.imports_of(path))
    return sorted(seen)
