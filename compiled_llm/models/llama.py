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
from compiled_llm.models.layers.linear import linear, pack_weight
from compiled_llm.models.layers.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
)
from compiled_llm.models.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class Biases:
    """Which projections carry a bias: the families differ (Qwen2: q/k/v only; Llama and Qwen3:
    q/k/v/o with `attention_bias`; Llama: the MLP with `mlp_bias`)."""

    qkv: bool = False
    o: bool = False
    mlp: bool = False


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, biases: Biases, qk_norm: bool, cpu_kernels: bool) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # This rank's heads (all of them without tensor parallelism).
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads, num_kv_heads, biases.qkv,
                                          cpu_kernels)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads = len(heads.q_heads), len(heads.kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_columns = range(heads.q_heads.start * self.head_dim, heads.q_heads.stop * self.head_dim)
        self.o_proj = RowParallelLinear(q_columns, config.hidden_size, biases.o, cpu_kernels)
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
    def __init__(self, config: Any, bias: bool, cpu_kernels: bool) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Unsupported hidden_act {config.hidden_act!r}; only silu is implemented.")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias,
                                                       cpu_kernels)
        self.down_proj = RowParallelLinear(self.gate_up_proj.part_rows[0], config.hidden_size, bias, cpu_kernels)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, biases: Biases, qk_norm: bool, cpu_kernels: bool) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, rotary, biases, qk_norm, cpu_kernels)
        self.mlp = DecoderMLP(config, biases.mlp, cpu_kernels)
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
    def __init__(self, config: Any, biases: Biases, qk_norm: bool, cpu_kernels: bool) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        theta, scaling = rope_parameters(config)
        rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, biases, qk_norm, cpu_kernels) for _ in range(config.num_hidden_layers)
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

    def __init__(self, config: Any, cpu_kernels: bool = False) -> None:
        """`cpu_kernels`: the linear layers call this project's C++ CPU kernel (built and loaded)."""
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.biases(config), self.qk_norm, cpu_kernels)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.cpu_kernels = cpu_kernels
        self.packed_lm_head: torch.Tensor | None = None  # set by process_weights_after_loading
        # This rank's slice of the vocabulary, as the embedding's (all of it without tensor parallelism).
        self.lm_head = None if self.tie_word_embeddings else ColumnParallelLinear(config.hidden_size, config.vocab_size,
                                                                                    cpu_kernel=cpu_kernels)

    @classmethod
    def biases(cls, config: Any) -> Biases:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return Biases(qkv=attention_bias, o=attention_bias, mlp=bool(getattr(config, "mlp_bias", False)))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of a flat batch of tokens: [T] ids and positions -> [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary, on every rank."""
        packed = self.packed_lm_head if self.lm_head is None else self.lm_head.packed_weight
        local = linear(hidden, self.lm_head_weight, None, self.cpu_kernels, packed)
        return gather_logits(local, self.config.vocab_size)

    def process_weights_after_loading(self) -> None:
        """With the C++ CPU kernels, a tied output projection gets a packed copy of the embedding
        table (which keeps its own layout for the lookups); an untied one packs itself."""
        tied = self.lm_head is None
        self.packed_lm_head = pack_weight(self.lm_head_weight) if tied and self.cpu_kernels else None

    # Checkpoint name fragments that load into one shard of a fused parameter.
    stacked_params = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )
