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

from compiled_llm.compilation.compile_cache import WEIGHTS_DIR, CompileCache, default_cache_root, read_ahead
from compiled_llm.config import ModelConfig
from compiled_llm.gguf_file import is_gguf
from compiled_llm.logger import init_logger
from compiled_llm.models.checkpoint import CheckpointTensor, read
from compiled_llm.models.gguf_loader import iterate_gguf
from compiled_llm.models.layers.linear import CheckpointWeight, LinearBase
from compiled_llm.models.packed_weights import PackedWeights, checkpoint_identity
from compiled_llm.models.registry import model_class
from compiled_llm.quantization import get_quantization_config

logger = init_logger(__name__)


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


def checkpoint_target(model: nn.Module, name: str) -> tuple[str, int | str | None]:
    """(the model's tensor, the part of it) that checkpoint tensor `name` fills (q, k, v into
    qkv_proj; gate, up into gate_up_proj)."""
    for fused, part, shard_id in getattr(model, "stacked_params", ()):
        if part in name:
            return name.replace(part, fused), shard_id
    return name, None


def restored_tensors(restored: set[str]) -> set[str]:
    """The weights of the layers `restored` from their packed state: filled without the checkpoint
    (a tied LM head's too: the embedding's tensor then fills only the embedding)."""
    return {f"{layer}.weight" for layer in restored}


def load_weights(model: nn.Module, weights: Iterator[tuple[str, CheckpointWeight]],
                 restored: set[str] = frozenset()) -> None:
    """Copy checkpoint tensors into the model, fusing q/k/v and gate/up; every parameter (and every
    linear layer's weight, however its method keeps it) must be filled. With tied embeddings the
    embedding's tensor is the LM head's weight too. `restored`: layers whose weight is in place
    already (their packed state, packed_weights.py), whose tensors are skipped."""
    done = restored_tensors(restored)
    targets: set[str] = {name for name, _ in model.named_parameters()}
    expected_shards: dict[str, int] = {}
    for name, module in model.named_modules():
        if getattr(module, "quant_method", None) is not None:  # linears, and an embedding kept quantized:
            targets.add(f"{name}.weight")  # their method may keep no `weight` parameter
        if isinstance(module, LinearBase):
            for part in ("weight",) + (("bias",) if module.bias is not None else ()):
                expected_shards[f"{name}.{part}"] = len(module.output_sizes)
    filled: dict[str, set] = {name: set(range(expected_shards.get(name, 1))) for name in done}
    tied = getattr(model, "tie_word_embeddings", False)
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        target, shard = checkpoint_target(model, name)
        if target not in targets:  # a weight this implementation would silently drop: wrong outputs
            raise ValueError(
                f"The checkpoint has tensor {name!r}, which {type(model).__name__} has no parameter for "
                f"(a config feature this engine does not implement?)."
            )
        destinations = [target] + (["lm_head.weight"] if tied and target == "model.embed_tokens.weight" else [])
        for destination in (d for d in destinations if d not in done):
            _load_one(model, destination, tensor, shard)
            filled.setdefault(destination, set()).add(shard)
    missing = [n for n in sorted(targets) if len(filled.get(n, ())) < expected_shards.get(n, 1)]
    if missing:
        raise ValueError(f"The checkpoint lacks {len(missing)} parameter(s), e.g. {', '.join(missing[:5])}.")


def _load_one(model: nn.Module, target: str, tensor: CheckpointWeight, shard: int | str | None) -> None:
    owner_name, _, param_name = target.rpartition(".")
    owner = model.get_submodule(owner_name)
    with torch.no_grad():
        if hasattr(owner, "load_checkpoint"):  # linear and embedding layers: their part, their format
            owner.load_checkpoint(param_name, tensor, shard)
            return
        part, param = read(tensor), getattr(owner, param_name)
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"{target}: checkpoint shape {tuple(part.shape)} != model {tuple(param.shape)}")
        param.data.copy_(part)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights (norms at 1) for benchmarks and GPU checks that have no checkpoint."""
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def normal(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(normal(tuple(param.shape)))
        for module in model.modules():  # linears whose method keeps no float weight parameter
            if isinstance(module, LinearBase) and not isinstance(getattr(module, "weight", None), nn.Parameter):
                module.quant_method.load(module, normal((module.out_features, module.in_features)), None)


def process_weights_after_loading(model: nn.Module, restored: set[str] = frozenset()) -> None:
    """Once the weights are in: let every layer that has one run its post-load step (the linear
    layers pack their weights for the C++ CPU kernels), as vLLM's loader does; the `restored`
    layers are packed already."""
    with torch.no_grad():
        for name, module in model.named_modules():
            step = getattr(module, "process_weights_after_loading", None) if name not in restored else None
            if callable(step):
                step()


def build_model(config: ModelConfig, device: torch.device, cpu_kernels: bool = False,
                packed_cache: CompileCache | None = None, require_cache_hit: bool = False) -> nn.Module:
    """The model of `config`, with weights (or random ones for `load_format="dummy"`), processed
    after loading, in eval mode. `cpu_kernels`: its linear layers call this project's C++ CPU kernels.
    `packed_cache`: the compile cache entry whose packed weights (packed_weights.py) it takes
    where they are there for this checkpoint, and saves them in where not (a strict start,
    `require_cache_hit`, creates no entry)."""
    load_format = config.load_format
    cls = model_class(config.architecture)
    quant_config = get_quantization_config(config.quantization, config)
    if quant_config is not None:
        logger.info("Weights: %s.", quant_config.describe())
    with _default_dtype(config.dtype), torch.device(device):
        model = cls(config.hf_config, cpu_kernels=cpu_kernels, quant_config=quant_config)
    if load_format == "dummy":
        init_dummy_weights(model, config.seed)
        process_weights_after_loading(model)
        return model.eval()
    if load_format != "auto":
        raise ValueError(f"Unknown load_format {load_format!r}; use auto or dummy.")
    packed = None
    if packed_cache is not None and cpu_kernels:  # packing is slow only for the C++ kernels' layouts
        packed = PackedWeights(packed_cache, config, checkpoint_paths(config.model), require_cache_hit)
    restored = packed.restore(model) if packed is not None else set()
    done = restored_tensors(restored)

    def needed(name: str) -> bool:
        return checkpoint_target(model, name)[0] not in done

    load_weights(model, iterate_gguf(config.model, config.hf_config, needed) if is_gguf(config.model)
                 else iterate_checkpoint(Path(config.model)), restored)
    process_weights_after_loading(model, restored)
    if packed is not None and not restored:
        packed.save(model)
    return model.eval()


def read_ahead_packed_weights(config: ModelConfig, cache_root: str | Path | None) -> None:
    """Start reading the packed weights a warm start of `config` will take from its compile cache
    entry, before the entry's key is known (computing it, and building the model, take the time
    the read and its checksum then overlap): a guess, the newest such file under `cache_root`. A
    wrong guess costs a read; the entry's own file is checked against its index either way."""
    try:
        root = Path(cache_root).expanduser() if cache_root else default_cache_root()
        name = f"{checkpoint_identity(config, checkpoint_paths(config.model))}.safetensors"
        found = list(root.glob(f"*/{WEIGHTS_DIR}/{name}"))
    except (OSError, ValueError):
        return
    if found:
        read_ahead(max(found, key=lambda path: _last_used(root, path.parent.parent.name, path)))


def _last_used(root: Path, key: str, fallback: Path) -> int:
    """When entry `key` was last used (its lock file's mtime), else when `fallback` was written."""
    for path in (root / f".{key}.lock", fallback):
        try:
            return path.stat().st_mtime_ns
        except OSError:
            continue
    return 0


def checkpoint_paths(model: str) -> list[Path]:
    """The files the weights of `model` (a GGUF file or a Hugging Face folder) are read from."""
    if is_gguf(model):
        return [Path(model)]
    folder = Path(model)
    index = folder / "model.safetensors.index.json"
    return checkpoint_files(folder) + ([index] if index.is_file() else [])
