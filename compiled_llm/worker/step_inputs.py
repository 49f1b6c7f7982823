"""The model's inputs for one step, in persistent buffers at fixed addresses (CUDA graphs replay
them in place): input ids, positions, slot mapping, query start offsets, sequence lengths and
block tables, gathered from the `InputBatch` rows with vectorised numpy and described by an
`AttentionMetadata`.
"""

from __future__ import annotations

import numpy as np
import torch

from compiled_llm.kernels.metadata import AttentionMetadata
from compiled_llm.worker.buffers import CpuGpuBuffer
from compiled_llm.worker.input_batch import InputBatch


class StepInputs:
    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size = block_size

        def buffer(*shape: int, dtype: torch.dtype = torch.int64, fill: int = 0) -> CpuGpuBuffer:
            return CpuGpuBuffer(*shape, dtype=dtype, device=device, fill=fill)

        self.input_ids = buffer(max_num_tokens)
        self.positions = buffer(max_num_tokens)
        self.slot_mapping = buffer(max_num_tokens, fill=-1)
        self.query_start_loc = buffer(max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = buffer(max_num_reqs, dtype=torch.int32)
        self.block_tables = buffer(max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        # LoRA: each token's adapter slot (-1: the base model), read by every LoRA layer.
        self.lora_indices = buffer(max_num_tokens, fill=-1)
        self._arange = np.arange(max(max_num_tokens, max_num_reqs) + 1, dtype=np.int64)
        # The host buffers are copied asynchronously; the next step may only overwrite them once
        # those copies ran (a step that samples nothing never waits on the device otherwise).
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def prepare(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        num_sched: np.ndarray,
        num_decodes: int,
        padded_tokens: int,
        padded_reqs: int,
        computed: np.ndarray | None = None,
        lora_slots: np.ndarray | None = None,
    ) -> tuple[AttentionMetadata, np.ndarray]:
        """Fill the buffers with the flat batch of `rows` (its `num_decodes` decodes first), padded
        to `padded_tokens` tokens and `padded_reqs` requests for a CUDA graph: padded tokens have
        slot -1 (no KV write), padded requests the null block, length 0 and the last offset.
        Returns the metadata (views of the buffers, sized to the padded batch) and the requests'
        sequence lengths. `computed`: where each row's tokens start (default: its computed tokens;
        a draft model catching up starts earlier). `lora_slots` (LoRA on): each request's adapter
        slot, spread over its tokens (padded tokens: -1)."""
        self._wait_for_copies()
        num_reqs = len(rows)
        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        if computed is None:
            computed = batch.num_computed_tokens[rows]
        token_req = np.repeat(np.arange(num_reqs), num_sched)
        token_rows = rows[token_req]
        positions = computed[token_req] + self._arange[:total] - np.repeat(cu - num_sched, num_sched)
        self.positions.np[:total] = positions
        self.input_ids.np[:total] = batch.token_ids[token_rows, positions]
        block_ids = batch.block_table[token_rows, positions // self.block_size]
        self.slot_mapping.np[:total] = block_ids * self.block_size + positions % self.block_size
        if lora_slots is not None:
            self.lora_indices.np[:total] = lora_slots[token_req]
            self.lora_indices.np[total:padded_tokens] = -1
            self.lora_indices.copy_to_device(padded_tokens)
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu
        seq_lens = computed + num_sched
        self.seq_lens.np[:num_reqs] = seq_lens
        self.block_tables.np[:num_reqs] = batch.block_table[rows]
        if padded_tokens > total:
            self.input_ids.np[total:padded_tokens] = 0
            self.positions.np[total:padded_tokens] = 0
            self.slot_mapping.np[total:padded_tokens] = -1
        if padded_reqs > num_reqs:
            self.query_start_loc.np[num_reqs + 1 : padded_reqs + 1] = total
            self.seq_lens.np[num_reqs:padded_reqs] = 0
            self.block_tables.np[num_reqs:padded_reqs] = 0
        metadata = self._publish(
            padded_tokens, padded_reqs, total, num_decodes, int(num_sched.max()), int(seq_lens.max())
        )
        return metadata, seq_lens

    def dummy(self, num_tokens: int, num_reqs: int = 1, query_lens: list[int] | None = None) -> AttentionMetadata:
        """`num_reqs` requests sharing `num_tokens` fresh tokens (or requests of `query_lens`) that
        write nothing to the KV cache (slot -1, the null block): for tracing, capturing graphs and
        profiling."""
        if query_lens is None:
            per_req = num_tokens // num_reqs
            query_lens = [per_req] * (num_reqs - 1) + [num_tokens - per_req * (num_reqs - 1)]
        lens = np.asarray(query_lens, dtype=np.int64)
        num_reqs = len(lens)
        starts = np.concatenate([[0], np.cumsum(lens)])
        self._wait_for_copies()
        self.input_ids.np[:num_tokens] = 0
        self.positions.np[:num_tokens] = np.concatenate([np.arange(n) for n in lens])
        self.slot_mapping.np[:num_tokens] = -1
        self.lora_indices.np[:num_tokens] = -1
        self.lora_indices.copy_to_device(num_tokens)
        self.query_start_loc.np[: num_reqs + 1] = starts
        self.seq_lens.np[:num_reqs] = lens
        self.block_tables.np[:num_reqs] = 0
        longest = int(lens.max())
        num_decodes = num_reqs if longest == 1 else 0
        return self._publish(num_tokens, num_reqs, num_tokens, num_decodes, longest, longest)

    def model_args(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's arguments for a step of `num_tokens` (padded) tokens: ids and positions."""
        return self.input_ids.gpu[:num_tokens], self.positions.gpu[:num_tokens]

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def _publish(
        self, num_tokens: int, num_reqs: int, num_actual_tokens: int, num_decodes: int, max_query_len: int,
        max_seq_len: int,
    ) -> AttentionMetadata:
        """Copy the filled host buffers to the device and describe them (views from the start of
        each buffer, so addresses never change)."""
        self.input_ids.copy_to_device(num_tokens)
        self.positions.copy_to_device(num_tokens)
        metadata = AttentionMetadata(
            num_actual_tokens=num_actual_tokens,
            num_reqs=num_reqs,
            num_decodes=num_decodes,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc.copy_to_device(num_reqs + 1),
            seq_lens=self.seq_lens.copy_to_device(num_reqs),
            block_tables=self.block_tables.copy_to_device(num_reqs),
            slot_mapping=self.slot_mapping.copy_to_device(num_tokens),
            query_start_loc_cpu=self.query_start_loc.np[: num_reqs + 1],
            seq_lens_cpu=self.seq_lens.np[:num_reqs],
        )
        if self._copied is not None:
            self._copied.record()
        return metadata
