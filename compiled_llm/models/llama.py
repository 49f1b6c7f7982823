"""The Llama decoder (SmolLM2 is one), written for this engine.

Qwen2 (bias on the QKV projection) and Qwen3 (RMSNorm on each query and key head) are the same
decoder with a flag each; their files subclass this one. `forward` is pure tensor code over one
flat batch of tokens: it is what Dynamo traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from compiled_llm.config import rope_parameters
from compiled_llm.models.layers.activation import SiluAndMul
from compiled_llm.models.layers.attention import Attention
from compiled_llm.models.layers.layernorm import RMSNorm
from compiled_llm.models.layers.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
)
from compiled_llm.models.layers.rotary import RotaryEmbedding
from compiled_llm.quantization.base import QuantizationConfig


@dataclass(frozen=True)
class Biases:
    """Which projections carry a bias: the families differ (Qwen2: q/k/v only; Llama and Qwen3:
    q/k/v/o with `attention_bias`; Llama: the MLP with `mlp_bias`)."""

    qkv: bool = False
    o: bool = False
    mlp: bool = False


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, biases: Biases, qk_norm: bool, cpu_kernels: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # This rank's heads (all of them without tensor parallelism).
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads, num_kv_heads, biases.qkv,
                                          cpu_kernels, quant_config, f"{prefix}.qkv_proj")
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads = len(heads.q_heads), len(heads.kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_columns = range(heads.q_heads.start * self.head_dim, heads.q_heads.stop * self.head_dim)
        self.o_proj = RowParallelLinear(q_columns, config.hidden_size, biases.o, cpu_kernels, quant_config,
                                        f"{prefix}.o_proj")
        self.rotary_emb = rotary
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class DecoderMLP(nn.Module):
    def __init__(self, config: Any, bias: bool, cpu_kernels: bool, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Unsupported hidden_act {config.hidden_act!r}; only silu is implemented.")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias,
                                                       cpu_kernels, quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(self.gate_up_proj.part_rows[0], config.hidden_size, bias, cpu_kernels,
                                           quant_config, f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, biases: Biases, qk_norm: bool, cpu_kernels: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, rotary, biases, qk_norm, cpu_kernels, quant_config,
                                          f"{prefix}.self_attn")
        self.mlp = DecoderMLP(config, biases.mlp, cpu_kernels, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, biases: Biases, qk_norm: bool, cpu_kernels: bool,
                 quant_config: QuantizationConfig | None, prefix: str = "model") -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        theta, scaling = rope_parameters(config)
        rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                                   f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, biases, qk_norm, cpu_kernels, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qk_norm = False

    def __init__(self, config: Any, cpu_kernels: bool = False, quant_config: QuantizationConfig | None = None) -> None:
        """`cpu_kernels`: the linear layers call this project's C++ CPU kernel (built and loaded).
        `quant_config`: how the linear layers keep their weights (None: as the checkpoint has them)."""
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.biases(config), self.qk_norm, cpu_kernels, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # This rank's slice of the vocabulary, as the embedding's (all of it without tensor parallelism).
        # Tied, it computes with the embedding's weight (or its own format of it: the loader gives it
        # the embedding's checkpoint tensor too).
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, cpu_kernel=cpu_kernels,
                                            quant_config=quant_config, prefix="lm_head")
        # (A table kept quantized has no float weight to share: the head loads the tensor its own way.)
        if self.tie_word_embeddings and self.model.embed_tokens.quant_method is None:
            self.lm_head.tie_to(self.model.embed_tokens.weight)

    @classmethod
    def biases(cls, config: Any) -> Biases:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return Biases(qkv=attention_bias, o=attention_bias, mlp=bool(getattr(config, "mlp_bias", False)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of a flat batch of tokens: [T] ids and positions -> [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary, on every rank."""
        return gather_logits(self.lm_head(hidden), self.config.vocab_size)

    # Checkpoint name fragments that load into one shard of a fused parameter.
    stacked_params = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )
