"""A GGUF file as MODEL: opened with every tensor checked; its config, tokenizer, chat template
and tensor table (type, shape, offset of each tensor) as a small Hugging Face folder (no weights)
written once under the user cache; llama.cpp's tensor names as the model's.

transformers reads the config and tokenizer from the file's metadata, and the gguf package its
tables, which takes seconds each (both parse the whole vocabulary); the folder is keyed by the
file's path, size and modification time, so a later start reads a few small files instead. The
weights stay in the file: the model loader (models/gguf_loader.py) reads their blocks from it
through a memory map, at the table's offsets. This module is shared: the engine's config reads the
folder, the quantization method the types, the loader the table and the names.

A truncated file, a damaged tensor table or an unknown tensor type is one `GGUFFileError` naming
the tensor (the gguf package itself fails on them with a bare numpy error).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compiled_llm.logger import init_logger
from compiled_llm.utils import UserError, user_cache_dir

logger = init_logger(__name__)

# GGUF's `general.architecture` -> the model class this engine builds (only Llama's tensor names
# and its q/k row order are mapped by the loader so far).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_FORMAT_VERSION = "2"  # bump when the folder's contents change
TENSOR_TABLE = "gguf_tensors.json"

# llama.cpp's name of a layer's tensor -> the model's (Llama; `blk.N.` -> `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Written by llama.cpp's converter for Llama 3's rope scaling; the rotary embedding computes the
# same frequencies from the config.
_SKIPPED = {"rope_freqs.weight"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFFileError(UserError, ValueError):
    """A GGUF file this engine cannot read: the message names the file and, where one is at fault,
    the tensor (the user's to fix: reported in one line, without a traceback)."""


def is_gguf(model: str | os.PathLike[str]) -> bool:
    return Path(model).suffix == ".gguf"


def open_gguf(path: str | os.PathLike[str]):  # -> gguf.GGUFReader
    """`path` memory-mapped, every tensor's type and extent checked against the file."""
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:
                _check_tensor(field, start_offs, len(self.data), path)
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(path)
    except GGUFFileError:
        raise
    except (ValueError, IndexError, UnicodeDecodeError, OverflowError) as e:
        raise GGUFFileError(f"{path} is not a readable GGUF file: {e}") from e


def _check_tensor(field, start_offs: int, file_size: int, path: str | os.PathLike[str]) -> None:
    """One entry of the tensor table: a known type, and data that lies inside the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _name_len, name_data, _n_dims, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", errors="replace")
    try:
        kind = GGMLQuantizationType(int(raw_type[0]))
    except ValueError:
        raise GGUFFileError(f"{path}: tensor {name!r} has unknown type id {int(raw_type[0])} "
                            "(a damaged file, or one newer than the gguf package)") from None
    block, block_bytes = GGML_QUANT_SIZES[kind]
    n_elements = int(np.prod(dims.astype(np.float64)))
    n_bytes = n_elements * block_bytes // block
    start = start_offs + int(offset[0])
    if n_elements % block or start + n_bytes > file_size:
        shape = "x".join(str(int(d)) for d in reversed(dims.tolist()))
        raise GGUFFileError(
            f"{path}: tensor {name!r} ({kind.name}, {shape}) needs bytes {start} to {start + n_bytes}, but the "
            f"file has {file_size} (truncated or damaged)")


def model_tensor_name(gguf_name: str) -> str | None:
    """The model's name for a GGUF tensor (None: one the model computes itself), or an error."""
    if gguf_name in _SKIPPED:
        return None
    layer = LAYER_TENSOR.fullmatch(gguf_name)
    if layer and layer.group(2) in _LAYER_TENSORS:
        return f"model.layers.{layer.group(1)}.{_LAYER_TENSORS[layer.group(2)]}.{layer.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _MODEL_TENSORS and kind in ("weight", "bias"):
        return f"{_MODEL_TENSORS[base]}.{kind}"
    raise GGUFFileError(f"GGUF tensor {gguf_name!r} has no place in a Llama model (unknown name).")


def metadata_folder(path: str | os.PathLike[str]) -> Path:
    """The folder with `path`'s config.json, generation_config.json, tokenizer and chat template,
    written on first use (lock-free: concurrent first starts each write one, the first rename wins)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist.")
    stat = path.stat()
    identity = f"{_FORMAT_VERSION}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    target = user_cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Reading the config and tokenizer of %s into %s, once.", path, target)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        _write_metadata(path, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():  # not another process's folder that won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's data lies in the file (checked against the file when the folder was
    written; the folder's key changes with the file's size and modification time)."""

    type: str  # the GGML type: "Q4_1", "F32"...
    shape: tuple[int, ...]  # in torch's order (GGUF lists the fastest dimension first)
    offset: int  # of its first byte in the file
    n_bytes: int


def tensor_table(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """Every tensor of the file at `path` by its GGUF name, from the metadata folder: the gguf
    package's reader parses the whole vocabulary to find them, which takes seconds."""
    table = json.loads((metadata_folder(path) / TENSOR_TABLE).read_text())
    return {name: TensorEntry(e["type"], tuple(e["shape"]), e["offset"], e["n_bytes"]) for name, e in table.items()}


def _write_metadata(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    reader = open_gguf(path)  # a damaged file fails here, naming the tensor, not inside transformers
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFFileError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                            f"{', '.join(GGUF_ARCHITECTURES)}.")
    if reader.byte_order != "I":
        raise GGUFFileError(f"{path} is a GGUF file of the other byte order, which this engine does not read.")
    table = {t.name: {"type": t.tensor_type.name, "shape": [int(d) for d in reversed(t.shape.tolist())],
                      "offset": int(t.data_offset), "n_bytes": int(t.n_bytes)} for t in reader.tensors}
    (out / TENSOR_TABLE).write_text(json.dumps(table, indent=0) + "\n")
    del reader
    folder, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.architectures = [GGUF_ARCHITECTURES[arch]]
    config.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else config.eos_token_id
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos, "pad_token_id": config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
