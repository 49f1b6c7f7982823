"""Shared fixtures: the real bundled model, tiny random-weight Llama/Qwen2/Qwen3 folders, HF oracles."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# `--dtype auto` is float32 in every test, bf16-capable CPU or not: KV budgets here are sized in
# bytes and many comparisons are exact (compiled_llm/config.py: AUTO_CPU_DTYPE_ENV).
os.environ.setdefault("COMPILED_LLM_CPU_AUTO_DTYPE", "float32")
torch.set_num_threads(int(os.environ.get("COMPILED_LLM_NUM_THREADS", 0)) or (os.cpu_count() or 1))

TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _tiny_config(arch: str, vocab_size: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, rope_theta=10000.0, **TINY_COMMON)
    if arch == "llama3-scaled":
        return LlamaConfig(
            vocab_size=vocab_size,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
            **{**TINY_COMMON, "tie_word_embeddings": True},
        )
    if arch == "llama-biased":  # bias on q/k/v/o (attention_bias) and on the MLP (mlp_bias)
        return LlamaConfig(vocab_size=vocab_size, rope_theta=10000.0, attention_bias=True, mlp_bias=True, **TINY_COMMON)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=vocab_size, rope_theta=1000000.0, **TINY_COMMON)
    if arch == "qwen2-tied":
        return Qwen2Config(vocab_size=vocab_size, rope_theta=1000000.0, **{**TINY_COMMON, "tie_word_embeddings": True})
    if arch == "qwen3":
        return Qwen3Config(vocab_size=vocab_size, rope_theta=1000000.0, head_dim=32, **TINY_COMMON)
    if arch == "qwen3-biased":
        return Qwen3Config(vocab_size=vocab_size, rope_theta=1000000.0, head_dim=32, attention_bias=True, **TINY_COMMON)
    raise ValueError(arch)


@pytest.fixture
def package_log(caplog):
    """pytest's `caplog`, seeing the package's log too: its logger writes to its own handler and
    does not propagate to the root (compiled_llm/logger.py), where only some pytest versions look."""
    import logging

    logger = logging.getLogger("compiled_llm")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def real_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct, converted to a Hugging Face folder."""
    from compiled_llm.bundled_model import bundled_model_path

    return str(bundled_model_path())


def make_tiny_model(arch: str, out: Path, tokenizer_source: str) -> str:
    """Write a random-weight HF model folder (config, safetensors, tokenizer) for `arch`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    src = Path(tokenizer_source)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(src))
    config = _tiny_config(arch, vocab)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initialises biases to zero, which would hide a dropped or misplaced bias
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, real_model_path):
    cache: dict[str, str] = {}

    def make(arch: str = "llama") -> str:
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), real_model_path)
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def warm_compile_cache(real_model_path) -> dict:
    """Runs `compiled-llm precompile` for the bundled model's float32 folder (`real_model_path`, which
    the tests name) with default settings: starts with those settings are warm afterwards. (CI's own
    precompile warms the default, the shipped GGUF file, as `compiled-llm serve` uses it.)"""
    import json
    import subprocess

    out = subprocess.run(["compiled-llm", "precompile", real_model_path, "--json"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def precompiled_default(tmp_path_factory) -> tuple[Path, dict]:
    """(a fresh compile cache, the report): one cold `compiled-llm precompile` of the served default
    (on a CPU the shipped Q4_1 GGUF file, as it ships) with default settings. Shared by the tests
    that need that cold compile (its report) or an entry it filled; they only start from it."""
    import json
    import subprocess

    cache = tmp_path_factory.mktemp("default-compile-cache")
    out = subprocess.run(["compiled-llm", "precompile", "--compile-cache", str(cache), "--json"], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return cache, json.loads(out.stdout.strip().splitlines()[-1])
