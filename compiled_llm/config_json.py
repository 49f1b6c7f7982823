"""A model's config.json read directly, for the architectures this engine implements.

transformers' `AutoConfig` imports torch.distributed and much of transformers (about 2 s of a
warm start's critical path, before the engine can start). For a Llama, Qwen2 or Qwen3 config.json
that states every field the engine reads, the file itself is the config: its values are read as
attributes, and each field a model class would default is read with the same default where it is
used (`getattr(config, "num_key_value_heads", None) or num_heads`). Any other config.json (another
model type, a field left to transformers' default) is read by `AutoConfig` as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# model_type -> the architecture it must name: a config.json that says otherwise goes to AutoConfig.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Read by the engine with no default of its own (transformers' classes default some of them).
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
            "rms_norm_eps", "max_position_embeddings")
# transformers' default differs from the engine's fallback (Qwen3's head_dim is 128, not
# hidden_size / heads): these must be stated.
REQUIRED_BY_TYPE = {"qwen3": ("head_dim",)}


class ConfigJSON:
    """config.json's fields as attributes (what `PretrainedConfig` offers the engine: attribute
    reads and `to_dict`)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.__dict__.update(data)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def __repr__(self) -> str:
        return f"ConfigJSON({json.dumps(vars(self), sort_keys=True)})"


def direct_config(data: dict[str, Any]) -> ConfigJSON | None:
    """`data` as the engine's config, or None where AutoConfig must read it (a type or a field
    this reader does not know transformers' defaults for)."""
    model_type = data.get("model_type")
    archs = data.get("architectures")
    if model_type not in MODEL_TYPES or not isinstance(archs, list) or archs[:1] != [MODEL_TYPES[model_type]]:
        return None
    if any(data.get(name) is None for name in (*REQUIRED, *REQUIRED_BY_TYPE.get(model_type, ()))):
        return None
    params = data.get("rope_parameters")
    if data.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        return None
    return ConfigJSON(data)


def read_config(folder: Path) -> Any:
    """The config of the model folder `folder`: a `ConfigJSON` where its config.json can be read
    directly, else transformers' `AutoConfig`."""
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        data = None  # AutoConfig says what is wrong with it
    config = direct_config(data) if isinstance(data, dict) else None
    if config is not None:
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)
