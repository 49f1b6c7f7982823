"""`gguf`: GGUF files read as the gguf package reads them, blocks kept packed."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig

from compiled_llm.bundled_model import bundled_gguf_path
from compiled_llm.gguf_file import metadata_folder, open_gguf
from compiled_llm.kernels.quantized_reference import QuantizedWeight, dequantize
from compiled_llm.models.gguf_loader import iterate_gguf, rotary_row_order


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return str(bundled_gguf_path())


def test_blocks_dequantize_as_the_gguf_package_does(gguf_path):
    reader = open_gguf(gguf_path)
    reference = {t.name: t for t in reader.tensors}
    wanted = {"model.embed_tokens.weight": "token_embd.weight",  # Q8_0
              "model.layers.3.mlp.down_proj.weight": "blk.3.ffn_down.weight",  # Q4_1
              "model.layers.7.self_attn.q_proj.weight": "blk.7.attn_q.weight",  # Q4_1, rows un-permuted
              "model.layers.7.self_attn.k_proj.weight": "blk.7.attn_k.weight",
              "model.norm.weight": "output_norm.weight"}  # F32
    hf_config = AutoConfig.from_pretrained(metadata_folder(gguf_path))
    seen = 0
    for name, loaded in iterate_gguf(gguf_path, hf_config):
        if name not in wanted:
            continue
        tensor = reference[wanted[name]]
        expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
        if "attn_q" in tensor.name or "attn_k" in tensor.name:
            heads = hf_config.num_attention_heads if "attn_q" in tensor.name else hf_config.num_key_value_heads
            expected = expected[torch.from_numpy(rotary_row_order(expected.shape[0], heads))]
        kind = tensor.tensor_type.name
        if kind in ("Q8_0", "Q4_1"):
            assert isinstance(loaded, QuantizedWeight) and loaded.bits == (8 if kind == "Q8_0" else 4)
            loaded = dequantize(loaded)
        assert torch.equal(loaded, expected), name
        seen += 1
    assert seen == len(wanted)
