"""Snapshots of transformers' tokenizers, so that a warm start needs `tokenizers` alone.

The first load of a tokenizer goes through transformers; its backend (`tokenizer.json` as
transformers left it) and the values a `FastTokenizer` needs are then written to
`<cache>/tokenizers/<key>/`, with the verdict of a comparison against transformers on the same
tokenizer: encodings and decodings of assorted texts (code, prose, special tokens, emoji, CJK,
spaces), every token's text, the special tokens and the chat template's renders of a few
conversations. Later loads use the snapshot only where that verdict is "equal"; elsewhere they
keep transformers (and say why once, at debug level).

The key covers the tokenizer's files (by content), the transformers and tokenizers versions and
this module's format: a change to any of them makes a fresh snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from compiled_llm.engine.chat_template_render import ChatTemplates
from compiled_llm.engine.fast_tokenizer import BACKEND_FILE, META_FILE, FastTokenizer
from compiled_llm.logger import init_logger
from compiled_llm.utils import user_cache_dir

logger = init_logger(__name__)

_FORMAT_VERSION = "1"
# The files transformers reads a tokenizer from; the key covers those present.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "vocab.txt")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def snapshot_folder(folder: str | os.PathLike[str]) -> Path:
    """Where the snapshot of the tokenizer in `folder` is (or would be) kept."""
    folder = Path(folder)
    digest = hashlib.sha256(f"{_FORMAT_VERSION}\0{_version('transformers')}\0{_version('tokenizers')}".encode())
    for name in _TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            digest.update(f"\0{name}\0".encode())
            digest.update(path.read_bytes())
    templates = folder / "additional_chat_templates"
    if templates.is_dir():
        for path in sorted(templates.glob("*.jinja")):
            digest.update(f"\0{path.name}\0".encode())
            digest.update(path.read_bytes())
    return user_cache_dir() / "tokenizers" / digest.hexdigest()[:20]


def _equal_meta(target: Path) -> dict[str, Any] | None:
    """The snapshot meta in `target` where it was found equal to transformers'; None where there
    is none yet, it differs, or it is damaged (said at debug level)."""
    try:
        meta = json.loads((target / META_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.debug("Tokenizer snapshot %s unusable (%s); using transformers.", target, e)
        return None
    if not isinstance(meta, dict) or meta.get("equal") is not True:
        logger.debug("Tokenizer snapshot %s: transformers kept (%s).", target,
                     meta.get("difference") if isinstance(meta, dict) else "damaged")
        return None
    return meta


def load_snapshot(folder: str | os.PathLike[str]) -> FastTokenizer | None:
    """The snapshot of `folder`'s tokenizer where one was written and found equal to
    transformers'; None where there is none yet or it was found to differ."""
    target = snapshot_folder(folder)
    meta = _equal_meta(target)
    if meta is None:
        return None
    try:
        return FastTokenizer.from_snapshot(target, str(folder))
    except Exception as e:  # noqa: BLE001 - damaged: transformers it is (and a fresh snapshot)
        logger.debug("Tokenizer snapshot %s unusable (%s); using transformers.", target, e)
        return None


def load_chat_templates(folder: str | os.PathLike[str]) -> ChatTemplates | None:
    """Only the chat template and special tokens of `folder`'s tokenizer, from its snapshot (where
    one was found equal to transformers'): what a chat template worker needs, without reading
    the vocabulary."""
    meta = _equal_meta(snapshot_folder(folder))
    try:
        return None if meta is None else ChatTemplates(meta["chat_template"], meta["special_tokens_map"])
    except (KeyError, TypeError, AttributeError):  # damaged: the worker loads the tokenizer instead
        return None


def write_snapshot(folder: str | os.PathLike[str], hf_tokenizer: Any) -> None:
    """Snapshot `hf_tokenizer` (transformers', loaded from `folder`) with its comparison's verdict;
    lock-free like the GGUF metadata folder (concurrent writers: the first rename wins). Never
    raises: a start goes on with transformers if this fails."""
    target = snapshot_folder(folder)
    try:
        if target.is_dir():
            try:
                json.loads((target / META_FILE).read_text())["equal"]
                return
            except (OSError, ValueError, KeyError, TypeError):  # damaged: written again below
                shutil.rmtree(target, ignore_errors=True)
        backend = hf_tokenizer._tokenizer
        meta = {
            "tokenizer_class": type(hf_tokenizer).__name__,
            "backend_model": type(backend.model).__name__,
            "special_tokens_map": {k: str(v) for k, v in hf_tokenizer.special_tokens_map.items()
                                   if isinstance(v, str) or hasattr(v, "content")},
            "all_special_tokens": [str(t) for t in hf_tokenizer.all_special_tokens],
            "all_special_ids": [int(i) for i in hf_tokenizer.all_special_ids],
            "chat_template": hf_tokenizer.chat_template,
            # name_or_path is the loading folder's: several folders with the same files share a snapshot
            "init_kwargs": json_value({k: v for k, v in hf_tokenizer.init_kwargs.items()
                                        if k not in ("vocab_file", "merges_file", "added_tokens_decoder",
                                                     "name_or_path", "tokenizer_file")}),
            "model_max_length": int(hf_tokenizer.model_max_length),
            "padding_side": hf_tokenizer.padding_side,
            "truncation_side": hf_tokenizer.truncation_side,
            "clean_up_tokenization_spaces": bool(hf_tokenizer.clean_up_tokenization_spaces),
        }
        ours = FastTokenizer(_copy_backend(backend), meta, str(folder))
        difference = first_difference(hf_tokenizer, ours)
        meta.update(equal=difference is None, difference=difference)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
        try:
            backend.save(str(staging / BACKEND_FILE))
            (staging / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
            try:
                os.rename(staging, target)
            except OSError:
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if difference is not None:
            logger.info("Tokenizer of %s: kept on transformers, which its snapshot does not match (%s).",
                        folder, difference)
    except Exception as e:  # noqa: BLE001 - an optimisation only
        logger.debug("Tokenizer snapshot of %s not written: %s", folder, e)


def _copy_backend(backend: Any) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(backend.to_str())


def json_value(value: Any) -> Any:
    """A tokenizer setting as JSON: a special token (an AddedToken) as its text, anything else JSON
    lacks as a string."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    return str(value)


def _sample_texts(special: list[str]) -> list[str]:
    """Texts that exercise a tokenizer: prose and code, whitespace runs, special tokens inside
    text, characters outside ASCII (accents, CJK, emoji, a joiner sequence)."""
    try:
        from pydoc_data.topics import topics

        prose = [topics[k][:600] for k in sorted(topics)[:12]]
    except ImportError:  # a Python built without its docs data
        prose = []
    texts = prose + [
        "", " ", "  leading and trailing  ", "\n\n\tindented\n", "Hello, world! Don't stop; it's 3.14 ... ok?",
        "def f(x):\n    return x ** 2  # squares\n", "naïve café — «déjà vu»", "日本語のテキストと中文",
        "emoji 🙂🚀👩‍👩‍👧",
        "numbers 1234567890 and 12,345.67", "URL https://example.com/a?b=c&d=e", "a" * 300,
    ]
    texts += [f"before{token}after" for token in special] + [" ".join(special)]
    return texts


def first_difference(hf: Any, ours: FastTokenizer) -> str | None:
    """Where `ours` differs from transformers' `hf` on the checks above; None where nowhere."""
    checks: list[tuple[str, Callable[[Any], Any]]] = [
        ("special tokens", lambda t: (dict(t.special_tokens_map), list(t.all_special_ids), t.eos_token_id,
                                      t.bos_token_id, t.pad_token_id, t.unk_token_id)),
        ("vocabulary", lambda t: (t.get_vocab(), len(t), t.vocab_size)),
        ("every token's text", lambda t: t.convert_ids_to_tokens(list(range(len(t))))),
    ]
    texts = _sample_texts(list(ours.all_special_tokens))
    for add in (True, False):
        checks.append((f"encodings (add_special_tokens={add})",
                       lambda t, add=add: [t(x, add_special_tokens=add)["input_ids"] for x in texts]))
    encoded = [hf(x, add_special_tokens=True)["input_ids"] for x in texts]
    rng = random.Random(0)
    ids = [[rng.randrange(len(ours)) for _ in range(rng.randrange(1, 24))] for _ in range(200)]
    ids += [[i] for i in ours.all_special_ids] + encoded
    for skip in (True, False):
        checks.append((f"decodings (skip_special_tokens={skip})",
                       lambda t, skip=skip: [t.decode(x, skip_special_tokens=skip) for x in ids]))
    if ours.chat_template is not None:
        for i, (messages, options) in enumerate(_sample_chats()):
            checks.append((f"chat template render {i}",
                           lambda t, m=messages, o=options: t.apply_chat_template(m, tokenize=False, **o)))
    for what, check in checks:
        if _outcome(check, hf) != _outcome(check, ours):
            return what
    return None


def _outcome(check: Callable[[Any], Any], tokenizer: Any) -> Any:
    """A check's value, or the kind of error it raised (the two must fail alike too)."""
    try:
        return ("ok", check(tokenizer))
    except Exception as e:  # noqa: BLE001 - a template's own error is an outcome to compare
        return ("error", type(e).__name__ if not isinstance(e, ValueError) else "ValueError")


def _sample_chats() -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}},
                                                             "required": ["city"]}}}
    user = {"role": "user", "content": "What is the weather in Paris? 🙂"}
    return [
        ([user], {"add_generation_prompt": True}),
        ([user], {"add_generation_prompt": False}),
        ([{"role": "system", "content": "Be brief."}, user, {"role": "assistant", "content": "Sunny."},
          {"role": "user", "content": "And tomorrow?"}], {"add_generation_prompt": True}),
        ([user, {"role": "assistant", "content": "It is"}], {"continue_final_message": True}),
        ([user], {"add_generation_prompt": True, "tools": [tool]}),
        ([user, {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "18 C"}], {"add_generation_prompt": True,
                                                                       "tools": [tool]}),
        ([user], {"add_generation_prompt": True, "enable_thinking": False}),
    ]
