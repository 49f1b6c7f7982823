"""`gguf`: a GGUF file's weights served as they ship, their Q8_0 / Q4_0 / Q4_1 blocks kept packed.

Each linear layer gets the method its tensors' type asks for: Q8_0 is 8-bit and Q4_0 / Q4_1 4-bit
in groups of 32 inputs (`WeightOnlyLinearMethod`, which packs them for the C++ GEMM that
de-quantizes in registers), F16 16-bit storage under float32 activations (`fp16_storage`'s
method: the GEMM widens in registers), F32 the float path. The LM head, tied to the embedding in small
models, takes the embedding's blocks. The embedding keeps its blocks too (one byte a weight plus a
scale per 32) and de-quantizes only the rows a step looks up.

Q4_K, Q6_K and the other k-quants are not served yet: a file holding one is an error naming the
tensor, as is a fused layer (q, k, v; gate, up) whose parts have different types.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from compiled_llm.config import ModelConfig
from compiled_llm.gguf_file import GGUFFileError, model_tensor_name, tensor_table
from compiled_llm.kernels.quantized_reference import QuantizedWeight
from compiled_llm.quantization.base import EmbeddingMethod, LinearMethod, Loaded, QuantizationConfig
from compiled_llm.quantization.fp16_storage import HalfStorageLinearMethod
from compiled_llm.quantization.weight_only import WeightOnlyLinearMethod

GROUP_SIZE = 32  # every GGUF block type served here covers 32 inputs
BLOCK_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
FLOAT_TYPES = ("F32", "F16")
# The model's fused layers and the checkpoint tensors each stacks (vLLM's packed_modules_mapping).
FUSED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LM_HEAD, EMBEDDING = "lm_head", "model.embed_tokens"


def unsupported(name: str, kind: str, path: str | Path = "The GGUF file") -> GGUFFileError:
    return GGUFFileError(
        f"{path}: tensor {name!r} is {kind}, which this engine cannot serve yet (supported: "
        f"{', '.join((*FLOAT_TYPES, *BLOCK_BITS))}; Q4_K, Q6_K and the other k-quants are not).")


class GGUFConfig(QuantizationConfig):
    """The types of one GGUF file's tensors, under the model's names."""

    name: ClassVar[str] = "gguf"

    def __init__(self, tensor_types: dict[str, str], activation_dtype: torch.dtype = torch.float32) -> None:
        """`tensor_types`: the model's tensor name -> its GGML type ("Q4_1", "F32"...)."""
        self.tensor_types = tensor_types
        self.activation_dtype = activation_dtype

    @classmethod
    def from_model_config(cls, model_config: ModelConfig) -> GGUFConfig:
        if model_config.quantization_options:
            raise ValueError(f"gguf takes no quantization options, got {sorted(model_config.quantization_options)}")
        return cls.from_file(model_config.model, model_config.dtype)

    @classmethod
    def from_file(cls, path: str | Path, activation_dtype: torch.dtype = torch.float32) -> GGUFConfig:
        """The types of the file's tensors; one this engine cannot serve is an error naming it."""
        types = {}
        for gguf_name, entry in tensor_table(path).items():
            kind = entry.type
            if kind not in FLOAT_TYPES and kind not in BLOCK_BITS:
                raise unsupported(gguf_name, kind, path)
            name = model_tensor_name(gguf_name)
            if name is not None:
                types[name] = kind
        return cls(types, activation_dtype)

    def weight_type(self, prefix: str) -> str:
        """The one type of the weight(s) of layer `prefix`: a fused layer's parts must agree."""
        if prefix == LM_HEAD and f"{LM_HEAD}.weight" not in self.tensor_types:
            prefix = EMBEDDING  # tied: the head multiplies by the embedding's blocks
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{part}.weight" for part in FUSED_LAYERS[leaf]] if leaf in FUSED_LAYERS else [
            f"{prefix}.weight"]
        missing = [n for n in names if n not in self.tensor_types]
        if missing:
            raise GGUFFileError(f"The GGUF file has no tensor {missing[0]!r} (for layer {prefix!r}).")
        kinds = {n: self.tensor_types[n] for n in names}
        if len(set(kinds.values())) > 1:
            raise GGUFFileError(f"Layer {prefix!r} fuses tensors of different GGUF types ({kinds}); not served yet.")
        kind = kinds[names[0]]
        if kind not in FLOAT_TYPES and kind not in BLOCK_BITS:
            raise unsupported(names[0], kind)
        return kind

    def linear_method(self, prefix: str) -> LinearMethod | None:
        kind = self.weight_type(prefix)
        if kind in BLOCK_BITS:
            return WeightOnlyLinearMethod(BLOCK_BITS[kind], GROUP_SIZE)
        if kind == "F16" and self.activation_dtype == torch.float32:
            return HalfStorageLinearMethod(torch.float16)  # an F16 file keeps its 2 bytes a weight
        return None

    def embedding_method(self, prefix: str) -> EmbeddingMethod | None:
        kind = self.weight_type(prefix)
        return GGUFEmbeddingMethod() if kind in BLOCK_BITS else None

    def cache_factors(self) -> dict[str, Any]:
        """The type of every tensor decides which op (and its bits) each layer's graph calls."""
        table = json.dumps(sorted(self.tensor_types.items())).encode()
        return {"method": self.name, "group_size": GROUP_SIZE, "types": self._counts(),
                "tensor_types_sha256": hashlib.sha256(table).hexdigest()[:16]}

    def describe(self) -> str:
        tied = f"{LM_HEAD}.weight" not in self.tensor_types
        linears = Counter(kind for name, kind in self.tensor_types.items() if name.endswith("_proj.weight"))
        parts = [f"{count} linears {kind}" for kind, count in sorted(linears.items())]
        head = f"lm_head {self.weight_type(LM_HEAD)}"
        parts.append(f"{head} (tied embedding)" if tied else f"{head}, embedding {self.weight_type(EMBEDDING)}")
        return f"gguf: {', '.join(parts)} (blocks kept packed; {self._counts()})"

    def _counts(self) -> str:
        counts = Counter(self.tensor_types.values())
        return ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))


class GGUFEmbeddingMethod(EmbeddingMethod):
    """An embedding table kept in its blocks: a lookup gathers the rows of the step's tokens and
    de-quantizes only those (pure tensor code, traced inside the compiled piece)."""

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        layer.embedding_dim, layer.params_dtype = embedding_dim, params_dtype
        layer.weight_device = torch.empty(0).device  # the device the model is built on
        for name in ("qweight", "scales", "mins"):
            layer.register_buffer(name, None, persistent=False)

    def load(self, layer: nn.Module, loaded: Loaded) -> None:
        if not isinstance(loaded, QuantizedWeight):
            raise ValueError("a GGUF block embedding needs its blocks, got a float tensor")
        if loaded.shape[1] != layer.embedding_dim or loaded.group_size != GROUP_SIZE:
            raise ValueError(f"shape mismatch: checkpoint {loaded.shape} vs embedding dim {layer.embedding_dim}")
        device = layer.weight_device  # scales and mins as in the file (fp16: they do not all fit bf16)
        layer.qweight, layer.scales = loaded.q.to(device), loaded.scales.to(device)
        layer.mins = None if loaded.mins is None else loaded.mins.to(device)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids`, de-quantized in float32 (scale q, + min: the reference's two roundings),
        in the model's dtype."""
        dim = layer.embedding_dim
        scales = layer.scales[ids].float().repeat_interleave(GROUP_SIZE, dim=-1, output_size=dim)
        rows = layer.qweight[ids].float() * scales
        if layer.mins is not None:
            rows = rows + layer.mins[ids].float().repeat_interleave(GROUP_SIZE, dim=-1, output_size=dim)
        return rows.to(layer.params_dtype)
