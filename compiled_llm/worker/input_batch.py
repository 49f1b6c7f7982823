"""Persistent per-request rows on the host: tokens, progress, block table and sampling settings.

A request keeps its row while it runs; each step only changes what changed (new blocks, new
tokens) instead of rebuilding lists of lists. The flat batch of a step is gathered from these
arrays with vectorised numpy.
"""

from __future__ import annotations

import numpy as np
import torch

from compiled_llm.sampling_params import SamplingParams


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device | str = "cpu"
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = torch.device(device)  # where seeded generators draw (beside the logits)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Sampling settings per row.
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.generators: dict[int, torch.Generator] = {}
        # Generators of preempted requests, by request id, until they come back or finish.
        self._parked_generators: dict[str, torch.Generator] = {}

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        block_ids: list[int],
        num_computed_tokens: int,
    ) -> int:
        row = self._free_rows.pop()
        self.req_ids[row] = req_id
        self.row_of[req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        self.params[row] = params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        generator = self._parked_generators.pop(req_id, None)
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=self.device)
            # Two's complement: every int64 seed is its own uint64 stream (-1 is not 2**63 - 1).
            generator.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
        if generator is not None:
            self.generators[row] = generator
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove(self, req_id: str, keep_sampling_state: bool = False) -> None:
        """Free the request's row. A preempted request (`keep_sampling_state`) keeps its seeded
        generator for when it comes back; otherwise any kept one is forgotten too."""
        if not keep_sampling_state:
            self._parked_generators.pop(req_id, None)
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        if keep_sampling_state and row in self.generators:
            self._parked_generators[req_id] = self.generators[row]
        self.req_ids[row] = None
        self.params[row] = None
        self.block_table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.generators.pop(row, None)
        self._free_rows.append(row)

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        if n < self.token_ids.shape[1]:
            self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
