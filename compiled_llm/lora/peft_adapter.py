"""A LoRA adapter read from PEFT's layout: `adapter_config.json` and `adapter_model.safetensors`.

What is supported is what the batched kernels apply: plain LoRA (`y += scaling * x A^T B^T`) on
the attention and MLP projections of a decoder layer, one rank and one alpha for every module
(`scaling = alpha / r`, or `alpha / sqrt(r)` with `use_rslora`). Anything else a PEFT adapter can
hold (DoRA, trained biases, `modules_to_save`, per-module ranks, embeddings) changes the model in
ways the slots cannot express, so it is refused by name rather than silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may follow lora_A)
_TENSOR_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.(lora_[AB])(?:\.\w+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter, the problem and the limit."""


@dataclass
class PEFTAdapter:
    """One adapter's weights on the host, float32: `weights[(layer, module)] = (A [r, in], B [out, r])`."""

    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}


def _config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter {folder}: no {CONFIG_FILE} (a PEFT adapter folder has "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE}).") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {folder}: {CONFIG_FILE} is not readable JSON ({e}).") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {folder}: {CONFIG_FILE} must hold a JSON object.")
    return config


def _check_options(folder: Path, config: dict, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling, after refusing what the kernels cannot apply."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {folder}: peft_type {peft_type!r} is not supported (LORA only).")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"LoRA adapter {folder}: r must be a positive integer, got {rank!r}.")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {folder}: rank {rank} is above max_lora_rank {max_rank} "
                               f"(start the engine with max_lora_rank >= {rank}).")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"LoRA adapter {folder}: lora_alpha must be a number, got {alpha!r}.")
    refused = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    named = [name for name, set_ in refused.items() if set_]
    if named:
        raise LoRAAdapterError(f"LoRA adapter {folder}: {', '.join(named)} not supported (plain LoRA on "
                               f"{', '.join(SUPPORTED_MODULES)} only).")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(str(t).rsplit(".", 1)[-1] for t in targets
                             if str(t).rsplit(".", 1)[-1] not in SUPPORTED_MODULES)
        if unsupported:
            raise LoRAAdapterError(f"LoRA adapter {folder}: target_modules {unsupported} not supported; "
                                   f"supported: {', '.join(SUPPORTED_MODULES)}.")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {folder}: no {WEIGHTS_FILE}.")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {folder}: {WEIGHTS_FILE} is damaged or not safetensors ({e}).") from None


def load_peft_adapter(path: str, max_rank: int) -> PEFTAdapter:
    """Read and check the adapter in folder `path`; raises `LoRAAdapterError` naming the problem."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {path}: not a folder.")
    rank, scaling = _check_options(folder, _config(folder), max_rank)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in _tensors(folder).items():
        match = _TENSOR_NAME.match(name)
        if match is None or match.group(2) not in SUPPORTED_MODULES:
            raise LoRAAdapterError(f"LoRA adapter {path}: tensor {name!r} is not a LoRA weight of a supported "
                                   f"module ({', '.join(SUPPORTED_MODULES)}).")
        halves.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    if not halves:
        raise LoRAAdapterError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights.")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        a, b = pair.get("lora_A"), pair.get("lora_B")
        if a is None or b is None:
            raise LoRAAdapterError(f"LoRA adapter {path}: layer {layer} {module} lacks its "
                                   f"{'lora_A' if a is None else 'lora_B'} weight.")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(f"LoRA adapter {path}: layer {layer} {module} has lora_A {tuple(a.shape)} and "
                                   f"lora_B {tuple(b.shape)}, not [r, in] and [out, r] with r = {rank}.")
        weights[(layer, module)] = (a.float(), b.float())
    return PEFTAdapter(str(folder), rank, scaling, weights)


def check_fits(adapter: PEFTAdapter, hf_config: object) -> None:
    """Raise `LoRAAdapterError` if `adapter` was not made for a model of `hf_config`'s shapes."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    for (layer, module), (a, b) in adapter.weights.items():
        if layer >= hf_config.num_hidden_layers:
            raise LoRAAdapterError(f"LoRA adapter {adapter.path}: it has weights for layer {layer}; the model has "
                                   f"{hf_config.num_hidden_layers} layers.")
        inputs, outputs = shapes[module]
        if a.shape[1] != inputs or b.shape[0] != outputs:
            raise LoRAAdapterError(
                f"LoRA adapter {adapter.path}: layer {layer} {module} maps {a.shape[1]} -> {b.shape[0]} features, "
                f"the model's {inputs} -> {outputs} (an adapter made for another model?).")
