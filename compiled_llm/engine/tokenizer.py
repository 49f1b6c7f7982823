"""Tokenizer loading and the per-token text used in logprobs."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

try:  # transformers 5: the module itself, so that `transformers.models` (1,100 files scanned) is not imported
    from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast
except ImportError:  # transformers 4
    from transformers import PreTrainedTokenizerFast

# tokenizer_config.json classes that are the generic fast tokenizer over tokenizer.json: loaded as
# such directly, because AutoTokenizer first resolves the model's config, whose imports (the model
# registry, torch.distributed.tensor) cost 1.5-3.5 s of a warm start on a 2-core machine.
_GENERIC_FAST = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def get_tokenizer(folder: str) -> Any:
    """The tokenizer in `folder` (`ModelConfig.tokenizer`: the model's folder, or a GGUF file's
    metadata folder)."""
    config = Path(folder) / "tokenizer_config.json"
    if (Path(folder) / "tokenizer.json").is_file() and config.is_file():
        try:
            tokenizer_class = json.loads(config.read_text()).get("tokenizer_class")
        except (OSError, ValueError):
            tokenizer_class = None
        if tokenizer_class in _GENERIC_FAST:
            return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class TokenTexts:
    """Text of single tokens (for `Logprob.decoded_token`), cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = lru_cache(maxsize=1 << 16)(lambda tid: tokenizer.decode([tid]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)
