"""Prompt logprobs: each prompt token's log probability given the tokens before it, its rank and
the top-k candidates, from the hidden states the step's compiled forward already computed (no
second, eager pass over the prompt).

A prompt chunk's hidden state at position p predicts token p + 1; the last prompt position
predicts the first generated token, which the sampler handles. Logits are computed only for the
positions of requests that ask, a bounded number of rows at a time, and a prompt split across
steps (chunked prefill) accumulates here until its last chunk, when it is handed out whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from compiled_llm.messages.runner_output import LogprobsLists

# Rows of logits computed at once: bounds the step's extra memory ([rows, vocab] float32, twice).
_ROWS_PER_CHUNK = 256


@dataclass
class PromptSegment:
    """One request's part of a step: its hidden states from flat row `flat_start` on predict the
    prompt tokens `targets`; `prompt_done`: the step computes the prompt's last token."""

    req_id: str
    flat_start: int
    targets: np.ndarray  # int64
    num_top: int
    prompt_done: bool


@dataclass
class PromptLogprobsTensors:
    token_ids: torch.Tensor  # [positions, 1 + k]: the prompt token, then the top k
    logprobs: torch.Tensor  # [positions, 1 + k]
    ranks: torch.Tensor  # [positions]: the prompt token's rank (1 = most likely)

    def to_lists(self) -> LogprobsLists:
        return LogprobsLists(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())


class PromptLogprobsComputer:
    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.compute_logits = compute_logits
        self._in_progress: dict[str, list[PromptLogprobsTensors]] = {}  # chunks so far, per request

    def forget(self, req_id: str) -> None:
        """The request finished or was preempted: a resumed prompt starts again from its start."""
        self._in_progress.pop(req_id, None)

    def compute(self, hidden: torch.Tensor, segments: list[PromptSegment]) -> dict[str, PromptLogprobsTensors]:
        """Logprobs of each segment's targets from the step's `hidden` states; returns the
        requests whose prompt is now done, whole."""
        flat = np.concatenate([s.flat_start + np.arange(len(s.targets)) for s in segments])
        targets = torch.from_numpy(np.concatenate([s.targets for s in segments])).to(hidden.device)
        rows = torch.from_numpy(flat).to(hidden.device)
        k = max(s.num_top for s in segments)
        parts = [self._chunk(hidden, rows[at : at + _ROWS_PER_CHUNK], targets[at : at + _ROWS_PER_CHUNK], k)
                 for at in range(0, len(flat), _ROWS_PER_CHUNK)]
        if parts:
            ids, lps, ranks = (torch.cat(tensors) for tensors in zip(*parts))
        else:  # only one-token prompts, or chunks that end on the last prompt token
            ids, lps, ranks = targets.unsqueeze(1), targets.unsqueeze(1).float(), targets
        done: dict[str, PromptLogprobsTensors] = {}
        offset = 0
        for s in segments:
            n, width = len(s.targets), 1 + s.num_top
            chunks = self._in_progress.setdefault(s.req_id, [])
            chunks.append(PromptLogprobsTensors(ids[offset : offset + n, :width], lps[offset : offset + n, :width],
                                                ranks[offset : offset + n]))
            offset += n
            if s.prompt_done:
                del self._in_progress[s.req_id]
                done[s.req_id] = PromptLogprobsTensors(
                    torch.cat([c.token_ids for c in chunks]), torch.cat([c.logprobs for c in chunks]),
                    torch.cat([c.ranks for c in chunks]),
                )
        return done

    def _chunk(
        self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logprobs = self.compute_logits(hidden.index_select(0, rows)).float().log_softmax(dim=-1)
        target_lp = logprobs.gather(1, targets.unsqueeze(1))
        ranks = (logprobs > target_lp).sum(dim=-1) + 1
        if k:
            top_lp, top_ids = logprobs.topk(k, dim=-1)
            return torch.cat([targets.unsqueeze(1), top_ids], 1), torch.cat([target_lp, top_lp], 1), ranks
        return targets.unsqueeze(1), target_lp, ranks
