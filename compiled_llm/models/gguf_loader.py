"""The weights of a GGUF file, under the model's own names, ready for `load_weights`.

llama.cpp names Llama's tensors its own way (`blk.0.attn_q.weight` for
`model.layers.0.self_attn.q_proj.weight`) and its converter permutes the rows of the query and key
projections within each head (it pairs rotary halves as (0, 1), (2, 3)... where the model rotates
(i, i + head_dim / 2)). Undoing that is a row permutation, and a block never spans two rows, so the
quantized blocks move whole: nothing is re-quantized. A Q8_0 / Q4_0 / Q4_1 tensor is handed on
as a `QuantizedWeight` (its blocks unpacked to one byte a weight, for the quantization method to
pack); F32 and F16 ones (the norms) as tensors. No float copy of a quantized weight is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from compiled_llm.gguf_file import LAYER_TENSOR, GGUFFileError, model_tensor_name, tensor_table
from compiled_llm.kernels.gguf_blocks import BLOCK_BYTES, blocks_to_quantized
from compiled_llm.kernels.quantized_reference import QuantizedWeight

FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}
SUPPORTED_TYPES = (*FLOAT_TYPES, *BLOCK_BYTES)


def rotary_row_order(rows: int, num_heads: int) -> np.ndarray:
    """Row i of the model's q or k projection is row `order[i]` of llama.cpp's (transformers'
    `reverse_permute` of LlamaModel.permute in convert_hf_to_gguf.py)."""
    head_dim = rows // num_heads
    return np.arange(rows).reshape(num_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(rows)


def iterate_gguf(path: str | Path, hf_config: Any, wanted: Callable[[str], bool] | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every tensor of the GGUF file at `path` (or those whose model name `wanted` accepts), under
    the model's names, read through a memory map at the offsets of the file's tensor table
    (gguf_file.py checked them, and keeps them)."""
    table = tensor_table(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    heads = {"attn_q": hf_config.num_attention_heads,
             "attn_k": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads}
    for gguf_name, entry in table.items():
        name = model_tensor_name(gguf_name)
        if name is None or (wanted is not None and not wanted(name)):
            continue
        kind, shape = entry.type, entry.shape
        if kind not in SUPPORTED_TYPES:
            raise GGUFFileError(
                f"{path}: tensor {gguf_name!r} is {kind}, which this engine cannot serve yet (supported: "
                f"{', '.join(SUPPORTED_TYPES)}; Q4_K and Q6_K are not).")
        raw = data[entry.offset:entry.offset + entry.n_bytes]
        raw = raw.view(FLOAT_TYPES[kind]) if kind in FLOAT_TYPES else raw
        layer = LAYER_TENSOR.fullmatch(gguf_name)
        if layer and layer.group(2) in heads:  # q and k: weights and biases alike
            raw = raw.reshape(shape[0], -1)[rotary_row_order(shape[0], heads[layer.group(2)])]
        if kind in FLOAT_TYPES:
            yield name, torch.from_numpy(np.array(raw).reshape(shape))
            continue
        try:
            weight = blocks_to_quantized(raw, kind, shape)
        except ValueError as e:
            raise GGUFFileError(f"{path}: tensor {gguf_name!r} ({kind}, {shape}): {e}") from e
        yield name, weight
