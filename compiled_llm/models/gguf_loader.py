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
from typing import Any, Iterator

import numpy as np
import torch

from compiled_llm.gguf_file import LAYER_TENSOR, GGUFFileError, model_tensor_name, open_gguf
from compiled_llm.kernels.gguf_blocks import BLOCK_BYTES, blocks_to_quantized
from compiled_llm.kernels.quantized_reference import QuantizedWeight

FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}
SUPPORTED_TYPES = (*FLOAT_TYPES, *BLOCK_BYTES)


def rotary_row_order(rows: int, num_heads: int) -> np.ndarray:
    """Row i of the model's q or k projection is row `order[i]` of llama.cpp's (transformers'
    `reverse_permute` of LlamaModel.permute in convert_hf_to_gguf.py)."""
    head_dim = rows // num_heads
    return np.arange(rows).reshape(num_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(rows)


def iterate_gguf(path: str | Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every tensor of the GGUF file at `path`, under the model's names."""
    reader = open_gguf(path)
    heads = {"attn_q": hf_config.num_attention_heads,
             "attn_k": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads}
    for tensor in reader.tensors:
        name = model_tensor_name(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise GGUFFileError(
                f"{path}: tensor {tensor.name!r} is {kind}, which this engine cannot serve yet (supported: "
                f"{', '.join(SUPPORTED_TYPES)}; Q4_K and Q6_K are not).")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists the fastest dim first
        data = np.asarray(tensor.data)
        layer = LAYER_TENSOR.fullmatch(tensor.name)
        if layer and layer.group(2) in heads:  # q and k: weights and biases alike
            data = data.reshape(shape[0], -1)[rotary_row_order(shape[0], heads[layer.group(2)])]
        if kind in FLOAT_TYPES:
            yield name, torch.from_numpy(np.array(data, dtype=FLOAT_TYPES[kind]).reshape(shape))
            continue
        try:
            weight = blocks_to_quantized(data, kind, shape)
        except ValueError as e:
            raise GGUFFileError(f"{path}: tensor {tensor.name!r} ({kind}, {shape}): {e}") from e
        yield name, weight
