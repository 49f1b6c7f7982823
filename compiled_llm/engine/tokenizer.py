"""Tokenizer loading and the per-token text used in logprobs."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from transformers import AutoTokenizer


def get_tokenizer(folder: str) -> Any:
    """The tokenizer in `folder` (`ModelConfig.tokenizer`: the model's folder, or a GGUF file's
    metadata folder)."""
    return AutoTokenizer.from_pretrained(folder)


class TokenTexts:
    """Text of single tokens (for `Logprob.decoded_token`), cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = lru_cache(maxsize=1 << 16)(lambda tid: tokenizer.decode([tid]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)
