"""Tokenizer loading and the per-token text used in logprobs.

A warm start takes the tokenizer from its snapshot (`tokenizer_snapshot.py`: `tokenizers` alone, no
transformers import); the first load of a tokenizer, and any tokenizer whose snapshot did not match
transformers on its checks, goes through transformers."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

# tokenizer_config.json classes that are the generic fast tokenizer over tokenizer.json: loaded as
# such directly, because AutoTokenizer first resolves the model's config, whose imports (the model
# registry, torch.distributed.tensor) cost 1.5-3.5 s of a warm start on a 2-core machine.
_GENERIC_FAST = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def get_tokenizer(folder: str) -> Any:
    """The tokenizer in `folder` (`ModelConfig.tokenizer`: the model's folder, or a GGUF file's
    metadata folder): its snapshot (`FastTokenizer`, no transformers import) where one was found
    equal to transformers' tokenizer; else transformers' own, snapshotting it on first load."""
    from compiled_llm.engine.tokenizer_snapshot import load_snapshot, write_snapshot

    snapshot = load_snapshot(folder)
    if snapshot is not None:
        return snapshot
    tokenizer = _transformers_tokenizer(folder)
    if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "_tokenizer"):
        write_snapshot(folder, tokenizer)
    return tokenizer


def _transformers_tokenizer(folder: str) -> Any:
    config = Path(folder) / "tokenizer_config.json"
    if (Path(folder) / "tokenizer.json").is_file() and config.is_file():
        try:
            tokenizer_class = json.loads(config.read_text()).get("tokenizer_class")
        except (OSError, ValueError):
            tokenizer_class = None
        if tokenizer_class in _GENERIC_FAST:
            try:  # transformers 5: the module itself, so that `transformers.models` (1,100 files) is not scanned
                from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast
            except ImportError:  # transformers 4
                from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class TokenTexts:
    """Text of single tokens (for `Logprob.decoded_token`), cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = lru_cache(maxsize=1 << 16)(lambda tid: tokenizer.decode([tid]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)
