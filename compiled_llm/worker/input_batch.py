"""Persistent per-request rows on the host: tokens, progress, block table, and (in `sampling`)
sampling settings.

A request keeps its row while it runs; each step only changes what changed (new blocks, new
tokens) instead of rebuilding lists of lists. The flat batch of a step is gathered from these
arrays with vectorised numpy (`StepInputs`), and so is its sampling metadata (`SamplingState`).
"""

from __future__ import annotations

import numpy as np
import torch

from compiled_llm.messages.scheduler_output import NewRequestData
from compiled_llm.worker.sampling_state import SamplingState


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        device: torch.device | str = "cpu",
        vocab_size: int = 1,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Speculative decoding: draft tokens this step verifies, written after a row's known tokens
        # (token_ids[row, num_tokens : num_tokens + num_drafts]) but not counted in num_tokens.
        self.num_drafts = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # A row whose last token was sampled by a step whose output the host has not read yet
        # (asynchronous scheduling): that step's number, and the token's index in its samples.
        self.pending_step = np.full(max_num_reqs, -1, dtype=np.int64)
        self.pending_index = np.zeros(max_num_reqs, dtype=np.int64)
        # Top candidates wanted with each prompt token's logprob while the prompt is computed;
        # -1: none (not asked, already handed out, or resumed after its first output).
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.vocab_size = vocab_size
        self.sampling = SamplingState(max_num_reqs, vocab_size, torch.device(device), eos_token_ids or [])

    def add(self, new: NewRequestData) -> int:
        row = self._free_rows.pop()
        self.req_ids[row] = new.req_id
        self.row_of[new.req_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.num_drafts[row] = 0
        self.pending_step[row] = -1
        wanted = new.sampling_params.prompt_logprobs
        fresh = n == new.num_prompt_tokens  # nothing generated yet: its prompt logprobs are still due
        self.num_prompt_logprobs[row] = -1 if wanted is None or not fresh else (
            self.vocab_size if wanted == -1 else min(wanted, self.vocab_size))
        self.append_blocks(row, new.block_ids)
        self.sampling.add(row, new.req_id, new.sampling_params, new.token_ids, new.num_prompt_tokens)
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def set_drafts(self, row: int, draft_ids: list[int]) -> None:
        """The draft tokens `row` verifies in this step, after its known tokens."""
        start = int(self.num_tokens[row])
        self.token_ids[row, start : start + len(draft_ids)] = draft_ids
        self.num_drafts[row] = len(draft_ids)

    def append_verified(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Each row's output tokens of a verification step (`tokens[i]`: row i's, padded with -1),
        written over its drafts; returns how many each row got."""
        valid = tokens >= 0
        which, offset = np.nonzero(valid)
        positions = self.num_tokens[rows][which] + offset
        fits = positions < self.token_ids.shape[1]
        self.token_ids[rows[which][fits], positions[fits]] = tokens[valid][fits]
        counts = valid.sum(axis=1)
        self.num_tokens[rows] += counts
        self.num_drafts[rows] = 0
        return counts

    def remove(self, req_id: str, keep_sampling_state: bool = False) -> None:
        """Free the request's row. A preempted request (`keep_sampling_state`) keeps its seeded
        generator for when it comes back; otherwise any kept one is forgotten too."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            if not keep_sampling_state:
                self.sampling.remove(-1, req_id, keep_generator=False)
            return
        self.sampling.remove(row, req_id, keep_sampling_state)
        self.req_ids[row] = None
        self.pending_step[row] = -1
        self.num_prompt_logprobs[row] = -1
        self.block_table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One new token for each of `rows` (sampled this step)."""
        positions = self.add_sampled(rows, step=-1)
        self.fill_tokens(rows, positions, tokens)

    def add_sampled(self, rows: np.ndarray, step: int) -> np.ndarray:
        """Count one token just sampled by `step` for each of `rows`, its id still on the device;
        returns where each goes. Until `fill_tokens` writes it, the next step reads it from there."""
        positions = self.num_tokens[rows].copy()
        self.num_tokens[rows] = positions + 1
        self.pending_step[rows] = step
        self.pending_index[rows] = np.arange(len(rows))
        return positions

    def fill_tokens(self, rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray, step: int = -1) -> None:
        """The ids of tokens counted by `add_sampled`, now on the host."""
        fits = positions < self.token_ids.shape[1]
        self.token_ids[rows[fits], positions[fits]] = tokens[fits]
        known = rows[self.pending_step[rows] == step]
        self.pending_step[known] = -1

    def num_output_tokens(self, rows: np.ndarray) -> np.ndarray:
        return self.num_tokens[rows] - self.num_prompt_tokens[rows]
