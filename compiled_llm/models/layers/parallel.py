"""Tensor-parallel layers: each rank holds a slice of a layer's weights and computes its share.

- Column-parallel linears (the fused QKV, gate-up, an untied LM head) keep a slice of the output
  rows; their outputs stay split, and the attention and SiLU that follow work on the slice.
- Row-parallel linears (the attention output and down projections) keep the matching slice of
  the input columns; their partial outputs are summed over the ranks by one all-reduce each.
- The embedding and the LM head keep a slice of the vocabulary.

Attention heads are split by key-value group, so grouped-query attention stays intact on every
rank; groups that do not divide evenly give the first ranks one more (SmolLM2's 3 groups of 3
query heads over 2 ranks: 6 and 3 heads). With fewer key-value heads than ranks, each key-value
head is replicated on the ranks that share it. At one rank every layer is the plain one.

Each layer loads its slice straight from the checkpoint (`load_checkpoint`): a rank reads only the
rows or columns it keeps (a row-parallel layer whose method quantizes at load reads the whole
weight, to quantize it before cutting its columns on group boundaries).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from compiled_llm.distributed.communication import all_gather_last_dim, all_reduce
from compiled_llm.distributed.parallel_state import tensor_parallel
from compiled_llm.models.checkpoint import read
from compiled_llm.models.layers.linear import CheckpointWeight, Linear, MergedLinear, cut
from compiled_llm.quantization.base import Loaded, QuantizationConfig


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` in `parts` as even as can be, the first ones one larger."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def shard_range(total: int, rank: int, world_size: int) -> range:
    sizes = split_sizes(total, world_size)
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


@dataclass(frozen=True)
class HeadPartition:
    """The query and key-value heads one rank holds."""

    q_heads: range
    kv_heads: range

    @classmethod
    def for_rank(cls, num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> "HeadPartition":
        group = num_heads // num_kv_heads
        if num_kv_heads >= world_size:
            kv = shard_range(num_kv_heads, rank, world_size)
            return cls(range(kv.start * group, kv.stop * group), kv)
        if world_size % num_kv_heads or num_heads % world_size:
            raise ValueError(
                f"Cannot split {num_heads} query heads and {num_kv_heads} key-value heads over {world_size} ranks: "
                "with fewer key-value heads than ranks, the ranks must be a multiple of the key-value heads and "
                "divide the query heads."
            )
        per_rank = num_heads // world_size
        q = range(rank * per_rank, (rank + 1) * per_rank)
        kv_head = rank // (world_size // num_kv_heads)
        return cls(q, range(kv_head, kv_head + 1))


class ColumnParallelLinear(Linear):
    """A slice of the output rows (all of them at one rank)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, cpu_kernel: bool = False,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
    ) -> None:
        tp = tensor_parallel()
        self.out_rows = shard_range(out_features, tp.rank, tp.world_size)
        super().__init__(in_features, len(self.out_rows), bias, cpu_kernel, quant_config, prefix)

    def cut_weight(self, loaded: CheckpointWeight, index: int | None) -> Loaded:
        return cut(loaded, 0, self.out_rows.start, len(self.out_rows))

    def cut_bias(self, loaded: CheckpointWeight, index: int | None) -> torch.Tensor:
        return read(loaded, 0, self.out_rows.start, len(self.out_rows))


class MergedColumnParallelLinear(MergedLinear):
    """Several column-parallel maps fused (gate and up): each part's slice, side by side."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, cpu_kernel: bool = False,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
    ) -> None:
        tp = tensor_parallel()
        self.part_rows = [shard_range(size, tp.rank, tp.world_size) for size in output_sizes]
        super().__init__(in_features, [len(rows) for rows in self.part_rows], bias, cpu_kernel, quant_config, prefix)

    def cut_weight(self, loaded: CheckpointWeight, index: int | None) -> Loaded:
        rows = self.part_rows[index]
        return cut(loaded, 0, rows.start, len(rows))

    def cut_bias(self, loaded: CheckpointWeight, index: int | None) -> torch.Tensor:
        rows = self.part_rows[index]
        return read(loaded, 0, rows.start, len(rows))


class QKVParallelLinear(MergedLinear):
    """The fused query, key and value projections of this rank's heads."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, cpu_kernel: bool = False,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
    ) -> None:
        tp = tensor_parallel()
        self.heads = HeadPartition.for_rank(num_heads, num_kv_heads, tp.rank, tp.world_size)
        self.head_dim = head_dim
        q, kv = len(self.heads.q_heads), len(self.heads.kv_heads)
        super().__init__(hidden_size, [q * head_dim, kv * head_dim, kv * head_dim], bias, cpu_kernel, quant_config,
                         prefix)

    def shard_index(self, shard: int | str | None) -> int | None:
        index = {"q": 0, "k": 1, "v": 2}.get(shard) if isinstance(shard, str) else None
        if index is None:
            raise ValueError(f"QKV shards are 'q', 'k' and 'v', got {shard!r}")
        return index

    def _rows(self, index: int | None) -> range:
        heads = self.heads.q_heads if index == 0 else self.heads.kv_heads
        return range(heads.start * self.head_dim, heads.stop * self.head_dim)

    def cut_weight(self, loaded: CheckpointWeight, index: int | None) -> Loaded:
        rows = self._rows(index)
        return cut(loaded, 0, rows.start, len(rows))

    def cut_bias(self, loaded: CheckpointWeight, index: int | None) -> torch.Tensor:
        rows = self._rows(index)
        return read(loaded, 0, rows.start, len(rows))


class RowParallelLinear(Linear):
    """A slice of the input columns (`in_columns`, matching the column-parallel layer before it);
    the partial outputs are summed over the ranks, and the bias added once, after the sum. A
    quantized weight is cut on group boundaries: a method that quantizes at load quantizes the
    whole weight first (`before_input_split`), so each rank keeps groups one rank would have."""

    def __init__(
        self, in_columns: range, out_features: int, bias: bool = False, cpu_kernel: bool = False,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__(len(in_columns), out_features, bias, cpu_kernel, quant_config, prefix)
        self.in_columns = in_columns
        self.parallel = tensor_parallel().world_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.parallel:
            return super().forward(x)
        out = all_reduce(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias

    def cut_weight(self, loaded: CheckpointWeight, index: int | None) -> Loaded:
        if not self.parallel:
            return cut(loaded)
        whole = self.quant_method.before_input_split(cut(loaded))
        return cut(whole, 1, self.in_columns.start, len(self.in_columns))


class VocabParallelEmbedding(nn.Module):
    """A slice of the vocabulary's embedding rows; a token outside the slice looks up zeros here,
    and the all-reduce brings in the rank that holds it."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        tp = tensor_parallel()
        self.vocab_rows = shard_range(vocab_size, tp.rank, tp.world_size)
        self.parallel = tp.world_size > 1
        # A table that arrives quantized (a GGUF file's blocks) is kept so and looked up by its method.
        self.quant_method = quant_config.embedding_method(prefix) if quant_config is not None else None
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(len(self.vocab_rows), hidden_size), requires_grad=False)
        else:
            self.quant_method.create_weights(self, len(self.vocab_rows), hidden_size, torch.get_default_dtype())

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel:
            return self.lookup(input_ids)
        start, stop = self.vocab_rows.start, self.vocab_rows.stop
        mine = (input_ids >= start) & (input_ids < stop)
        local = torch.where(mine, input_ids - start, torch.zeros_like(input_ids))
        rows = self.lookup(local)
        return all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    def load_checkpoint(self, name: str, loaded: CheckpointWeight, shard: object) -> None:
        if self.quant_method is not None:
            self.quant_method.load(self, cut(loaded, 0, self.vocab_rows.start, len(self.vocab_rows)))
            return
        part = read(loaded, 0, self.vocab_rows.start, len(self.vocab_rows))
        if tuple(part.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"shape mismatch: checkpoint slice {tuple(part.shape)} vs model {tuple(self.weight.shape)}")
        self.weight.data.copy_(part)


def gather_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The whole vocabulary's logits from each rank's slice (every rank gets them)."""
    return all_gather_last_dim(local_logits, split_sizes(vocab_size, tensor_parallel().world_size))
