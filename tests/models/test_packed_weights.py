"""Packed weights kept in the compile cache entry (models/packed_weights.py): a second load takes
them from there, with the same weights as packing the checkpoint again; the file is checksummed,
checked by `compiled-llm cache verify`, carried by export and import, and replaced when the
checkpoint changes. A tiny Llama quantized to int8 at load (packed for the C++ GEMM); no compiling."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiled_llm.compilation.compile_cache import CompileCache
from compiled_llm.config import ModelConfig
from compiled_llm.entrypoints.cli import main
from compiled_llm.kernels.cpu_extension import uses_cpu_kernels
from compiled_llm.models.loader import build_model

KEY = "0123456789abcdef"
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(not uses_cpu_kernels(CPU, torch.float32), reason="needs the C++ CPU kernels")


@pytest.fixture(scope="module")
def config(tiny_llama) -> ModelConfig:
    return ModelConfig.from_folder(tiny_llama, "float32", CPU, quantization="int8")


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model computes with (the packed ones are non-persistent buffers)."""
    return {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()] if t is not None}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def load(config: ModelConfig, root: Path | None, strict: bool = False) -> dict[str, torch.Tensor]:
    cache = CompileCache(root, KEY, {"test": 1}) if root is not None else None
    return weights_of(build_model(config, CPU, cpu_kernels=True, packed_cache=cache, require_cache_hit=strict))


def packed_files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / KEY / "weights").iterdir())


@pytest.fixture(scope="module")
def reference(config) -> dict[str, torch.Tensor]:
    return load(config, None)


def zero_tensor_keeping_mtime(checkpoint: Path, name: str) -> None:
    """Overwrite tensor `name`'s bytes in place: same size, same mtime (the packed file's identity)."""
    import json

    stat = checkpoint.stat()
    data = bytearray(checkpoint.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:8 + header_len])[name]["data_offsets"]
    data[8 + header_len + start:8 + header_len + end] = bytes(end - start)
    checkpoint.write_bytes(bytes(data))
    os.utime(checkpoint, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_second_load_takes_the_packed_weights_from_the_entry(tiny_llama, reference, tmp_path):
    import shutil

    folder = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    config = ModelConfig.from_folder(str(folder), "float32", CPU, quantization="int8")
    assert_same(load(config, tmp_path), reference)  # packs the checkpoint and saves what it made
    cache = CompileCache(tmp_path, KEY, {})
    (name,) = packed_files(tmp_path)
    assert f"weights/{name}" in cache.listed() and cache.verify() == []
    assert not any(rel.startswith("weights/") for rel in cache.stage().files)  # read by the loader only
    # The layer's checkpoint tensor is not read again: its packed weight comes from the entry.
    zero_tensor_keeping_mtime(next(folder.glob("*.safetensors")), "model.layers.0.self_attn.q_proj.weight")
    assert_same(load(config, tmp_path), reference)
    assert packed_files(tmp_path) == [name]


def test_verify_names_a_damaged_file_and_the_next_load_rebuilds_it(config, reference, tmp_path, capsys):
    load(config, tmp_path)
    (name,) = packed_files(tmp_path)
    path = tmp_path / KEY / "weights" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["cache", "verify", "--compile-cache", str(tmp_path)]) != 0
    assert f"weights/{name} does not match its checksum" in capsys.readouterr().out
    assert_same(load(config, tmp_path), reference)  # the damaged file is not read; the checkpoint is
    assert main(["cache", "verify", "--compile-cache", str(tmp_path)]) == 0


def test_export_and_import_carry_the_packed_weights(config, reference, tmp_path):
    load(config, tmp_path / "a")
    archive = tmp_path / "entry.tar"
    assert main(["cache", "export", KEY, "-o", str(archive), "--compile-cache", str(tmp_path / "a")]) == 0
    assert main(["cache", "import", str(archive), "--compile-cache", str(tmp_path / "b")]) == 0
    assert packed_files(tmp_path / "b") == packed_files(tmp_path / "a")
    assert_same(load(config, tmp_path / "b"), reference)


def test_a_changed_checkpoint_replaces_the_packed_file(tiny_llama, tmp_path):
    import shutil

    folder = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    config = ModelConfig.from_folder(str(folder), "float32", CPU, quantization="int8")
    load(config, tmp_path / "cache")
    before = packed_files(tmp_path / "cache")
    checkpoint = next(folder.glob("*.safetensors"))
    os.utime(checkpoint, ns=(checkpoint.stat().st_atime_ns, checkpoint.stat().st_mtime_ns + 10**9))
    fresh = load(config, tmp_path / "cache")
    after = packed_files(tmp_path / "cache")
    assert len(after) == 1 and after != before  # another identity; the stale file is gone
    assert CompileCache(tmp_path / "cache", KEY, {}).verify() == []
    assert_same(fresh, load(config, None))


def test_a_strict_load_without_an_entry_writes_nothing(config, reference, tmp_path):
    assert_same(load(config, tmp_path / "cache", strict=True), reference)
    assert not (tmp_path / "cache" / KEY).exists()


def test_the_engine_config_is_read_without_transformers(tiny_model_factory):
    """config.json of a Llama, Qwen2 or Qwen3 is read directly (transformers' import is ~2 s of a
    start), and the engine sees what AutoConfig would give it."""
    from transformers import AutoConfig

    from compiled_llm.config_json import ConfigJSON, read_config

    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
              "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
              "eos_token_id", "architectures")
    from compiled_llm.config import rope_parameters

    for arch in ("llama", "llama3-scaled", "qwen2", "qwen3"):
        folder = Path(tiny_model_factory(arch))
        direct, auto = read_config(folder), AutoConfig.from_pretrained(folder)
        assert isinstance(direct, ConfigJSON), arch
        assert {f: getattr(direct, f, None) for f in fields} == {f: getattr(auto, f, None) for f in fields}, arch
        assert rope_parameters(direct) == rope_parameters(auto), arch
        assert getattr(direct, "head_dim", None) == getattr(auto, "head_dim", None), arch
    probe = ("import sys, torch; from compiled_llm.config import ModelConfig; "
             f"ModelConfig.from_folder({tiny_model_factory('llama')!r}, 'auto', torch.device('cpu')); "
             "assert 'transformers' not in sys.modules, 'transformers was imported'")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_config_json_leaving_a_field_to_transformers_is_read_by_autoconfig(tiny_llama, tmp_path):
    import json
    import shutil

    from transformers import PretrainedConfig

    from compiled_llm.config_json import read_config

    folder = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    data = json.loads((folder / "config.json").read_text())
    del data["rms_norm_eps"]  # LlamaConfig's default (1e-6) applies
    (folder / "config.json").write_text(json.dumps(data))
    config = read_config(folder)
    assert isinstance(config, PretrainedConfig) and config.rms_norm_eps == 1e-6


def test_16_bit_storage_is_taken_from_the_entry_too(tiny_llama, tmp_path):
    config = ModelConfig.from_folder(tiny_llama, "float16", CPU)  # fp16 storage under float32 activations
    assert config.quantization == "fp16_storage"
    reference = load(config, None)
    assert_same(load(config, tmp_path), reference)
    assert len(packed_files(tmp_path)) == 1
    assert_same(load(config, tmp_path), reference)  # restored: the packed copy, no float16 `weight` kept


def test_the_packed_file_read_ahead_is_used_only_where_it_is_what_the_index_says(config, reference, tmp_path,
                                                                                  package_log):
    """A warm start reads the packed weights ahead (models/loader.py: read_ahead_packed_weights)
    while it builds the model; the bytes read ahead count only where they are what the index
    lists: a file replaced since is read again, a damaged one refused as any read refuses it."""
    import compiled_llm.compilation.compile_cache as compile_cache
    from compiled_llm.models.loader import read_ahead_packed_weights

    compile_cache.drop_read_ahead()  # whatever an earlier start in this process guessed
    load(config, tmp_path)
    (name,) = packed_files(tmp_path)
    rel, path = f"weights/{name}", tmp_path / KEY / "weights" / name
    read_ahead_packed_weights(config, tmp_path)
    assert list(compile_cache._read_ahead) == [str(path)]  # the guess: this entry's file
    assert_same(load(config, tmp_path), reference)
    assert compile_cache._read_ahead == {}  # taken by the load

    # Replaced (and listed anew) after it was read ahead: the new bytes are read.
    read_ahead_packed_weights(config, tmp_path)
    cache = CompileCache(tmp_path, KEY, {})
    with cache.opened():
        assert cache.replace_file(rel, b"new bytes")
    assert CompileCache(tmp_path, KEY, {}).read_verified(rel) == b"new bytes"
    assert compile_cache._read_ahead == {}

    # Damaged before it was read ahead: refused, named, and the next load packs the checkpoint again.
    path.write_bytes(b"new bytez")
    read_ahead_packed_weights(config, tmp_path)
    assert CompileCache(tmp_path, KEY, {}).read_verified(rel) is None
    assert "does not match its checksum" in package_log.text
    path.unlink()
    assert_same(load(config, tmp_path), reference)
