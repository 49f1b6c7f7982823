"""Root conftest of the run folder (copied there by run.py).

vLLM's test modules import `vllm` at their top, mostly for classes that only its own unit tests
use (those tests are deselected by adaptations.toml). So that the modules import without vLLM
installed, every `vllm.*` module here is a stub: its attributes are placeholder classes that raise
when used. The few helpers the server tests do call are real (`HELPERS`), built on the bundled
model, never on the hub. Tests named in `deselect.json` (written by run.py) are deselected with
their reason.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))


class StubbedVllmError(RuntimeError):
    pass


class _StubMeta(type):
    def __call__(cls, *args, **kwargs):
        raise StubbedVllmError(f"{cls.__module__}.{cls.__name__} is a stub: this test uses vLLM's internals")

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise StubbedVllmError(f"{cls.__module__}.{cls.__name__}.{name} is a stub")


def _bundled_tokenizer(*args, **kwargs):
    from transformers import AutoTokenizer

    from compiled_llm.bundled_model import bundled_model_path

    return AutoTokenizer.from_pretrained(str(bundled_model_path()))


def _get_open_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _HubApi:
    """`hf_api()` of vLLM's LoRA fixtures: every adapter they download is the bundled model's."""

    def snapshot_download(self, *args, **kwargs) -> str:
        from tests.utils import bundled_lora

        return bundled_lora()


class _ModelConfig:
    """`ModelConfig(model=...)` as vLLM's tests use it: only to ask the vocabulary size."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def get_vocab_size(self) -> int:
        import json

        from compiled_llm.bundled_model import bundled_model_path

        with open(bundled_model_path() / "config.json") as f:
            return json.load(f)["vocab_size"]


def _server_version() -> str:
    """What `/version` reports is the server's own version, so tests compare with that."""
    from importlib.metadata import version

    if os.environ.get("VLLM_OPENAI_TESTS_SERVER") == "vllm":
        sys.path.insert(0, os.environ["VLLM_OPENAI_TESTS_BENCHMARKS"])
        import peer_vllm

        return peer_vllm.VERSION
    return version("compiled-llm")


HELPERS: dict[str, dict[str, object]] = {
    "vllm.transformers_utils.repo_utils": {"hf_api": _HubApi},
    "vllm.config": {"ModelConfig": _ModelConfig},
    "vllm.envs": {"VLLM_USE_RUST_FRONTEND": False},
    "vllm.tokenizers": {"get_tokenizer": _bundled_tokenizer},
    "vllm.transformers_utils.tokenizer": {"get_tokenizer": _bundled_tokenizer},
    "vllm.utils.network_utils": {"get_open_port": _get_open_port},
    "vllm.version": {"__version__": _server_version(), "_prev_minor_version": lambda: "0.31"},
    "vllm.utils.serial_utils": {"EMBED_DTYPES": {"float32": None, "float16": None, "bfloat16": None},
                                "ENDIANNESS": ["native", "big", "little"]},
}


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules or full in HELPERS:  # `from vllm import envs`: the submodule, with its helpers
            return importlib.import_module(full)
        stub = _StubMeta(name, (), {"__module__": self.__name__})
        setattr(self, name, stub)
        return stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        module.__dict__.update(HELPERS.get(module.__name__, {}))


sys.meta_path.insert(0, _StubFinder())


def _deselections() -> list[dict[str, str]]:
    path = os.path.join(_HERE, "deselect.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def pytest_collection_modifyitems(config, items):
    rules = _deselections()
    kept, dropped = [], []
    for item in items:
        # "tests/entrypoints/.../test_x.py::test_name[param]" -> match module and test name
        module = item.nodeid.split("::")[0]
        name = item.nodeid.split("::")[-1]
        rule = next((r for r in rules if r["module"] == module and fnmatch.fnmatchcase(name, r["test"])), None)
        (dropped if rule else kept).append(item)
        if rule:
            item.user_properties.append(("deselected", rule["reason"]))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        with open(os.path.join(_HERE, "deselected.json"), "w") as f:
            json.dump({i.nodeid: dict(i.user_properties)["deselected"] for i in dropped}, f, indent=1)
    items[:] = kept
