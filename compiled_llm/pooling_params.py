"""`PoolingParams`: what one pooling request (an embedding, a raw pooled vector) asks of the
pooler (vLLM's names). A msgspec Struct, like `SamplingParams`, so it crosses to the engine as
msgpack."""

from __future__ import annotations

from typing import Any

import msgspec

POOLING_TASKS = ("embed", "encode", "token_embed")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    # "embed": normalised as the pooler config says (and `dimensions` allowed); "encode": the pooled
    # hidden state as it is, unless `normalize` asks; "token_embed": one embedding per prompt token
    # (vLLM's per-token task), each normalised as an embedding is.
    task: str = "embed"
    # Matryoshka truncation: the first `dimensions` values, normalised again (embed models that allow it).
    dimensions: int | None = None
    normalize: bool | None = None  # None: the pooler config's (embed) or off (encode)

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task {self.task!r}; known: {', '.join(POOLING_TASKS)}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")

    def verify(self, hidden_size: int, hf_config: Any) -> None:
        """`dimensions` only where the model was trained for it (vLLM: `is_matryoshka`, and its
        `matryoshka_dimensions` where it lists them)."""
        if self.dimensions is None:
            return
        if self.task != "embed":
            raise ValueError("dimensions applies to embeddings (task embed) only.")
        allowed = getattr(hf_config, "matryoshka_dimensions", None)
        if not (getattr(hf_config, "is_matryoshka", False) or allowed):
            raise ValueError("Model does not support matryoshka representation, changing output dimensions "
                             "will lead to poor results.")
        if allowed and self.dimensions not in allowed:
            raise ValueError(f"Model only supports {list(allowed)} matryoshka dimensions, got {self.dimensions}.")
        if self.dimensions > hidden_size:
            raise ValueError(f"dimensions ({self.dimensions}) must be at most the model's hidden size ({hidden_size}).")

    def clone(self, **changes: Any) -> PoolingParams:
        return msgspec.structs.replace(self, **changes)
