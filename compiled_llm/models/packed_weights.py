"""The model's weights as packed after loading, kept in the compile cache entry for the next start.

Packing a quantized (or 16-bit stored) linear layer's weight for the C++ CPU GEMM takes a second
pass over the checkpoint: its fused parts stacked, then laid out in panels (on a loaded 2-core
machine about 6 s of the bundled 135M model's 8 s load, where reading the GGUF file takes 1 s).
What packing makes depends only on the checkpoint's bytes, the weight format and the kernels'
layout, so it is saved once beside the compiled artifacts, as one safetensors file listed in the
entry's index (checksummed, and signed with the entry's key, like them), and a later start takes
the layers it holds from there: their checkpoint tensors are neither read nor packed again.

The file is named after the checkpoint's identity (each file's resolved path, size and mtime),
the weight format and the C++ kernels' build (their sources, flags and torch version): a changed
checkpoint or kernel gives another name, so a stale file is never used, and saving the new one
replaces it (an entry holds the packed weights of the checkpoint it last loaded).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from compiled_llm.compilation.compile_cache import WEIGHTS_DIR, CompileCache
from compiled_llm.config import ModelConfig
from compiled_llm.kernels.cpu_extension import build_dir
from compiled_llm.logger import init_logger

logger = init_logger(__name__)

FORMAT_VERSION = 1  # of this file's layout


def checkpoint_identity(config: ModelConfig, files: list[Path]) -> str:
    """What the packed weights were made from and how: a hash naming their file."""
    parts: list[object] = [FORMAT_VERSION, config.quantization, config.quantization_options, str(config.dtype),
                           build_dir().name]
    for path in files:
        stat = path.stat()
        parts.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def packed_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's layers whose weight method can keep a packed state, by name."""
    return {name: m for name, m in model.named_modules() if hasattr(getattr(m, "quant_method", None), "packed_state")}


class PackedWeights:
    """The packed-weights file of one checkpoint in one compile cache entry. The entry is held (its
    lock) only to read or write the file; a start that can neither (no entry yet, or nothing
    packed to keep) leaves no trace. `require_cache_hit`: a strict start, which creates no entry."""

    def __init__(self, cache: CompileCache, config: ModelConfig, checkpoint_files: list[Path],
                 require_cache_hit: bool = False) -> None:
        self.cache = cache
        self.rel = f"{WEIGHTS_DIR}/{checkpoint_identity(config, checkpoint_files)}.safetensors"
        self.require_cache_hit = require_cache_hit

    def restore(self, model: nn.Module) -> set[str]:
        """Put the stored packed state into the model's layers; the names of the layers restored
        (none where the entry holds no file for this checkpoint, or one it cannot vouch for)."""
        if not self.cache.entry.is_dir():
            return set()
        with self.cache.opened(self.require_cache_hit):
            data = self.cache.read_verified(self.rel)
        if data is None:
            return set()
        tensors = load_safetensors(data)
        layers = packed_layers(model)
        try:
            header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
            states: dict[str, dict[str, int]] = json.loads(header["__metadata__"]["layers"])
            unknown = sorted(set(states) - set(layers))
            if unknown:
                raise KeyError(unknown[0])
        except (KeyError, ValueError, TypeError) as e:  # checksummed, so written here, but for another model
            raise ValueError(f"{self.cache.entry / self.rel} does not fit this model ({e!r}): remove it "
                             "(`compiled-llm cache prune`) to rebuild it") from None
        for name, ints in states.items():
            prefix = name + "."
            state = {**ints, **{key[len(prefix):]: t for key, t in tensors.items() if key.startswith(prefix)}}
            layers[name].quant_method.restore_packed(layers[name], state)
        logger.info("Packed weights of %d layers taken from the compile cache (%s).", len(states), self.rel)
        return set(states)

    def save(self, model: nn.Module) -> None:
        """Store the packed state of every layer that has one (where the entry may be written)."""
        tensors: dict[str, torch.Tensor] = {}
        states: dict[str, dict[str, int]] = {}
        for name, layer in packed_layers(model).items():
            state = layer.quant_method.packed_state(layer)
            if state is None:
                continue
            states[name] = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            tensors.update({f"{name}.{k}": v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)})
        if not states:
            return
        data = save_safetensors(tensors, metadata={"layers": json.dumps(states)})
        with self.cache.opened(self.require_cache_hit):
            if self.cache.writable and self.cache.replace_file(self.rel, data):
                logger.info("Packed weights of %d layers saved in the compile cache (%s, %.0f MB).", len(states),
                            self.rel, len(data) / 1e6)

