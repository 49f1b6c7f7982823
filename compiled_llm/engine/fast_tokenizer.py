"""A tokenizer over the `tokenizers` library alone, loaded from a snapshot of transformers' own.

transformers' fast tokenizers are a `tokenizers.Tokenizer` (the "backend") plus the tokenizer
config's special tokens, chat template and a few decoding rules. Importing transformers costs
0.5-0.8 s on a 2-core machine, in the server's start and in every chat template worker; this class
does the same from a snapshot (`tokenizer_snapshot.py`): the backend exactly as transformers built
it (added special tokens, post-processor and all) and the values transformers computed. The
snapshot is used only where it was checked equal to transformers on the model's own tokenizer.

It answers the calls the engine, the server and their tests make (`__call__`, `encode`, `decode`,
the token/id conversions, the special tokens, `apply_chat_template`); anything else is an
AttributeError that names this class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from tokenizers import Tokenizer

from compiled_llm.engine.chat_template_render import ChatTemplates, select_template

BACKEND_FILE = "tokenizer.json"
META_FILE = "snapshot.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (WordPiece's spaces before punctuation)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class FastTokenizer:
    """transformers' `PreTrainedTokenizerFast`, for what a server needs of it."""

    is_fast = True

    def __init__(self, backend: Tokenizer, meta: dict[str, Any], name_or_path: str = "") -> None:
        self._tokenizer = backend
        self.name_or_path = name_or_path
        self.tokenizer_class: str = meta["tokenizer_class"]
        self.special_tokens_map: dict[str, Any] = meta["special_tokens_map"]
        self.all_special_tokens: list[str] = meta["all_special_tokens"]
        self.all_special_ids: list[int] = meta["all_special_ids"]
        self.chat_template: str | dict[str, str] | None = meta["chat_template"]
        self.init_kwargs: dict[str, Any] = {**meta["init_kwargs"], "name_or_path": name_or_path}
        self.model_max_length: int = meta["model_max_length"]
        self.padding_side: str = meta.get("padding_side", "right")
        self.truncation_side: str = meta.get("truncation_side", "right")
        self.clean_up_tokenization_spaces: bool = meta["clean_up_tokenization_spaces"]
        # transformers skips the clean-up for BPE models (it would strip real spaces before punctuation)
        self._clean_up = self.clean_up_tokenization_spaces and meta["backend_model"] != "BPE"
        for name in SPECIAL_TOKEN_NAMES:
            token = self.special_tokens_map.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else self.convert_tokens_to_ids(token))

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @classmethod
    def from_snapshot(cls, folder: str | Path, name_or_path: str = "") -> "FastTokenizer":
        folder = Path(folder)
        meta = json.loads((folder / META_FILE).read_text())
        return cls(Tokenizer.from_file(str(folder / BACKEND_FILE)), meta, name_or_path)

    # ---- encoding ---------------------------------------------------------------------------
    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs: Any) -> dict[str, Any]:
        self._refuse(kwargs, "__call__")
        if isinstance(text, str):
            encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask}
        encodings = self._tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings], "attention_mask": [e.attention_mask for e in encodings]}

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        self._refuse(kwargs, "encode")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens

    # ---- decoding ---------------------------------------------------------------------------
    def decode(self, token_ids: int | Iterable[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self._clean_up if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        return _clean_up_tokenization(text) if clean else text

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False,
                     **kwargs: Any) -> list[str]:
        return [self.decode(ids, skip_special_tokens, **kwargs) for ids in sequences]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    # ---- the vocabulary ---------------------------------------------------------------------
    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in special]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        if isinstance(tokens, str):
            index = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as transformers counts it)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self._tokenizer.get_added_tokens_decoder().items()))

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {token.content: index for index, token in self.added_tokens_decoder.items()}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    # ---- chat -------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        return select_template(self.chat_template, chat_template, tools)

    def apply_chat_template(self, conversation: Any, tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs: Any) -> Any:
        """One conversation as text (`tokenize=False`) or its token ids (with `return_dict`, as
        `{"input_ids": ...}`); a batch of conversations is not served here."""
        text = ChatTemplates(self.chat_template, self.special_tokens_map).render(
            conversation, chat_template, tools, documents, add_generation_prompt, continue_final_message, **kwargs)
        if not tokenize:
            return text
        encoded = self(text, add_special_tokens=False)
        return encoded if return_dict else encoded["input_ids"]

    @staticmethod
    def _refuse(kwargs: dict[str, Any], method: str) -> None:
        if kwargs:
            raise NotImplementedError(f"FastTokenizer.{method} does not take {sorted(kwargs)}; load the tokenizer "
                                      "with transformers for padding, truncation or tensors.")

    def __repr__(self) -> str:
        return f"FastTokenizer({self.tokenizer_class}, {self.name_or_path!r}, vocabulary {len(self)})"
