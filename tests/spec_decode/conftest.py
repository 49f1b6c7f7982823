"""A tiny random model with a small vocabulary: its greedy outputs soon repeat themselves, so n-gram
proposals exist and are often accepted, and sampled distributions have few outcomes to compare."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def small_vocab_llama(tmp_path_factory, real_model_path) -> str:
    from transformers import AutoModelForCausalLM

    from tests.conftest import _tiny_config

    out = tmp_path_factory.mktemp("tiny-llama-v16")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(real_model_path) / name).exists():
            shutil.copy(Path(real_model_path) / name, out / name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tiny_config("llama", 16), dtype=torch.float32).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def other_small_vocab_llama(tmp_path_factory, small_vocab_llama) -> str:
    """Another random model with the same 16-token vocabulary: its guesses are mostly wrong."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import _tiny_config

    out = tmp_path_factory.mktemp("tiny-llama-v16-other")
    for path in Path(small_vocab_llama).iterdir():
        if path.name.startswith("tokenizer") or path.name == "generation_config.json":
            shutil.copy(path, out / path.name)
    torch.manual_seed(1234)
    AutoModelForCausalLM.from_config(_tiny_config("llama", 16), dtype=torch.float32).save_pretrained(out)
    return str(out)
