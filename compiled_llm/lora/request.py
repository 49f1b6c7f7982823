"""`LoRARequest`: which adapter a request runs with, in vLLM's spelling.

A msgspec Struct, so it crosses to the engine core inside `EngineCoreRequest` as plain data.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """`lora_name`: the adapter's name (what the server lists); `lora_int_id`: a positive integer
    unique per adapter (it keys the loaded adapters and the prefix cache); `lora_path`: a folder
    with PEFT's `adapter_config.json` and `adapter_model.safetensors`."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1, "
                             f"got {self.lora_int_id!r}.")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path (the adapter's folder) is required.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> bytes:
        """The prefix-cache extra key of this adapter's blocks: a block computed under one adapter
        is never reused for another (or for the base model)."""
        return f"lora:{self.lora_int_id}:{self.lora_name}".encode()
