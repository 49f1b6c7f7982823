"""The cache key's sources: what can shape compiled code, and nothing the server or CLI alone runs."""

from __future__ import annotations

from pathlib import Path

from compiled_llm.compilation.cache_key import package_sources, source_digests
from compiled_llm.compilation.source_closure import SourceTree, import_closure

REPO = Path(__file__).resolve().parents[2]


def test_the_key_hashes_the_graph_building_code_and_not_the_server():
    files = {p.resolve().relative_to(REPO).as_posix() for p in package_sources()}
    for shaping in ("compiled_llm/models/llama.py", "compiled_llm/models/layers/attention.py",
                    "compiled_llm/compilation/backend.py", "compiled_llm/compilation/partition.py",
                    "compiled_llm/kernels/cpu_attention.py",
                    "compiled_llm/quantization/int8.py", "compiled_llm/worker/model_runner.py",
                    "compiled_llm/worker/step_inputs.py", "compiled_llm/distributed/communication.py",
                    "compiled_llm/config.py"):
        assert shaping in files, shaping
    for outside in ("compiled_llm/entrypoints/cli.py", "compiled_llm/entrypoints/openai/api_server.py",
                    "compiled_llm/engine/async_llm.py", "compiled_llm/core/scheduler.py",
                    "compiled_llm/executor/multiproc.py", "compiled_llm/__init__.py"):
        assert outside not in files, outside
    assert not [f for f in files if "tool_parsers" in f]


def test_every_import_form_is_followed(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg import public\n",
        "root.py": "import os\nfrom pkg.sub import (\n    near,\n    far,\n)\n\ndef f():\n    from . import lazy\n",
        "sub/__init__.py": "",
        "sub/near.py": "from .deep import x\n",
        "sub/far.py": "from pkg.sub.deep \\\n    import y\n",
        "sub/deep.py": "x = y = 1\n",
        "lazy.py": '"""from pkg import docstring: prose is not an import statement."""\n',
        "public.py": "",
        "unused.py": "",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    tree = SourceTree({"pkg": pkg})
    closure = import_closure(tree, [pkg / "root.py"], leaves={pkg / "__init__.py"})
    assert {p.relative_to(pkg).as_posix() for p in closure} == {
        "root.py", "sub/__init__.py", "sub/near.py", "sub/far.py", "sub/deep.py", "lazy.py"}


def test_sources_are_named_by_module_so_a_miss_can_say_which_changed(tmp_path):
    digests = source_digests(package_sources())
    assert "compiled_llm.models.llama" in digests and "compiled_llm.compilation.backend" in digests
    outside = tmp_path / "model_file.py"
    outside.write_text("x = 1\n")
    assert source_digests([outside]) == {"model_file.py": source_digests([outside])["model_file.py"]}


def test_a_docstring_that_swallows_lines_does_not_hide_the_imports_after_it(tmp_path):
    """A docstring line reading like an import with an open bracket makes the line reader join the
    lines after it into one unparsable statement: the file's imports then come from its whole tree."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "root.py").write_text('"""\nfrom here import the rest (of the story\n"""\nimport pkg.hidden\n')
    (pkg / "hidden.py").write_text("")
    closure = import_closure(SourceTree({"pkg": pkg}), [pkg / "root.py"], leaves=set())
    assert {p.relative_to(pkg).as_posix() for p in closure} == {"root.py", "hidden.py"}


def test_config_values_are_read_from_context_variables_and_plain_values(monkeypatch):
    """torch 2.13 keeps a config entry's override in a ContextVar, older releases as the value
    itself, which may be a dict (torch 2.11's Inductor has dict settings: `.get()` is not a
    ContextVar's there)."""
    import contextvars
    import sys
    import types
    from dataclasses import dataclass
    from typing import Any

    from torch.utils._config_module import _UNSET_SENTINEL

    from compiled_llm.compilation.cache_key import config_fingerprint

    @dataclass
    class Entry:
        default: Any
        user_override: Any = _UNSET_SENTINEL

    var = contextvars.ContextVar("override", default=_UNSET_SENTINEL)
    var.set(7)
    module = types.ModuleType("torch._inductor.config")
    module._config = {"as_dict": Entry({}, {"fused": True}), "in_var": Entry(1, var), "unset": Entry(3),
                      "same": Entry({"a": 1}, {"a": 1}), "cpp.vec_isa_ok": Entry(None, True)}
    monkeypatch.setitem(sys.modules, "torch._inductor.config", module)
    assert config_fingerprint("torch._inductor.config")["set_in_process"] == {"as_dict": "{'fused': True}",
                                                                              "in_var": "7"}
