"""vLLM's `--lora-modules` values and its switch for loading adapters at run time: parsed with the
command line, before anything heavy is imported."""

from __future__ import annotations

import json
from dataclasses import dataclass

from compiled_llm.utils import env_flag

# vLLM's switch for POST /v1/load_lora_adapter and /v1/unload_lora_adapter, and ours.
RUNTIME_LORA_UPDATING_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "COMPILED_LLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating_allowed() -> bool:
    return env_flag(*RUNTIME_LORA_UPDATING_ENV)


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """vLLM's two forms: `name=path`, or JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            return LoRAModulePath(str(spec["name"]), str(spec["path"]), spec.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f'{text!r}: expected {{"name": ..., "path": ...}} ({e})') from e
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"{text!r}: expected name=path or a JSON object")
    return LoRAModulePath(name, path)
