"""Build a model from a Hugging Face folder: the class from config.json, the weights from safetensors.

Checkpoint files are opened memory-mapped and read tensor by tensor, so loading never holds a
second copy of the whole model.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from compiled_llm.config import ModelConfig
from compiled_llm.models.checkpoint import CheckpointTensor, read
from compiled_llm.models.layers.linear import MergedLinear
from compiled_llm.models.registry import model_class


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a safetensors index (no readable weight_map: {e!r}).") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that are missing: {', '.join(missing)}.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors weights in {folder} (found: {', '.join(sorted(p.name for p in folder.iterdir()))})."
        )
    return files


def iterate_checkpoint(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint, not read yet: each layer reads what it keeps."""
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, CheckpointTensor(f, name)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, CheckpointTensor | torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model, fusing q/k/v and gate/up; every parameter must be filled."""
    params = dict(model.named_parameters())
    expected_shards = {
        f"{name}.{p}": len(module.output_sizes)
        for name, module in model.named_modules()
        if isinstance(module, MergedLinear)
        for p, _ in module.named_parameters(recurse=False)
    }
    filled: dict[str, set] = {}
    stacked = getattr(model, "stacked_params", ())
    tied = getattr(model, "tie_word_embeddings", False)
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        target, shard = name, None
        for fused, part, shard_id in stacked:
            if part in name:
                target, shard = name.replace(part, fused), shard_id
                break
        param = params.get(target)
        if param is None:  # a weight this implementation would silently drop: wrong outputs
            raise ValueError(
                f"The checkpoint has tensor {name!r}, which {type(model).__name__} has no parameter for "
                f"(a config feature this engine does not implement?)."
            )
        owner = model.get_submodule(target.rpartition(".")[0])
        with torch.no_grad():
            if hasattr(owner, "load_checkpoint"):  # a tensor-parallel layer reads only its slice
                owner.load_checkpoint(param, tensor, shard)
                filled.setdefault(target, set()).add(shard)
                continue
            tensor = read(tensor)
            if shard is None:
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                param.data.copy_(tensor)
            else:
                owner.load_shard(param, tensor, shard)
        filled.setdefault(target, set()).add(shard)
    missing = [n for n in params if len(filled.get(n, ())) < expected_shards.get(n, 1)]
    if missing:
        raise ValueError(f"The checkpoint lacks {len(missing)} parameter(s), e.g. {', '.join(missing[:5])}.")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights (norms at 1) for benchmarks and GPU checks that have no checkpoint."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                cpu = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
                param.copy_(cpu)


def process_weights_after_loading(model: nn.Module) -> None:
    """Once the weights are in: let every layer that has one run its post-load step (the linear
    layers pack their weights for the C++ CPU kernels), as vLLM's loader does."""
    with torch.no_grad():
        for module in model.modules():
            step = getattr(module, "process_weights_after_loading", None)
            if callable(step):
                step()


def build_model(config: ModelConfig, device: torch.device, cpu_kernels: bool = False) -> nn.Module:
    """The model of `config`, with weights (or random ones for `load_format="dummy"`), processed
    after loading, in eval mode. `cpu_kernels`: its linear layers call this project's C++ CPU kernels."""
    load_format = config.load_format
    cls = model_class(config.architecture)
    with _default_dtype(config.dtype), torch.device(device):
        model = cls(config.hf_config, cpu_kernels=cpu_kernels)
    if load_format == "dummy":
        init_dummy_weights(model, config.seed)
    elif load_format == "auto":
        load_weights(model, iterate_checkpoint(Path(config.model)))
    else:
        raise ValueError(f"Unknown load_format {load_format!r}; use auto or dummy.")
    process_weights_after_loading(model)
    return model.eval()
