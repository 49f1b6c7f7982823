"""The pooling runner's pooler: one vector per prompt from the final hidden states the compiled
model returns already (no lm_head, no sampling), as vLLM's LAST, MEAN and CLS poolers do.

A prompt may be computed in several chunks (chunked prefill): LAST reads the last chunk's last
row; MEAN keeps a running float32 sum per request across chunks; CLS keeps the first position's
row from the first chunk. MEAN and CLS need every prompt position computed here, so the engine
turns prefix caching off for them (`PoolerConfig.supports_prefix_caching`); LAST does not: a
cached prefix is never the last token, which is always computed. A preempted request starts over
(its partial state is forgotten with its row).

Per request, after pooling: `dimensions` keeps the first values (Matryoshka), then the vector is
normalised if asked (an embedding by default, as the pooler config says).

A `token_embed` request (vLLM's per-token task) pools nothing: it gets every prompt position's row,
each normalised as an embedding, kept chunk by chunk until its prompt ends (the request skips the
prefix cache, as prompt logprobs do, so that no position is missing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_llm.config import PoolerConfig
from compiled_llm.messages.runner_output import PooledTensor
from compiled_llm.pooling_params import PoolingParams


@dataclass
class PoolSegment:
    """One request's rows in a step: `num` hidden rows from flat row `offset`, which are its
    positions `start .. start + num - 1`; `done`: they end its prompt."""

    req_id: str
    offset: int
    num: int
    start: int
    done: bool


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self.params: dict[str, PoolingParams] = {}
        # MEAN: (sum of rows so far, in float32, and how many); CLS: (the first row, 1).
        self.partial: dict[str, tuple[torch.Tensor, int]] = {}
        self.token_rows: dict[str, list[torch.Tensor]] = {}  # token_embed: the chunks' rows so far

    def add(self, req_id: str, params: PoolingParams | None) -> None:
        self.params[req_id] = params or PoolingParams()
        self.partial.pop(req_id, None)
        self.token_rows.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """The request finished, was aborted or preempted (it starts over when it comes back)."""
        self.params.pop(req_id, None)
        self.partial.pop(req_id, None)
        self.token_rows.pop(req_id, None)

    def pool(self, hidden: torch.Tensor, segments: list[PoolSegment]) -> dict[str, PooledTensor]:
        """The vectors of the requests whose prompt ends in this step (`hidden`: the step's flat rows)."""
        kind = self.config.pooling_type
        vectors: dict[str, torch.Tensor] = {}
        per_token = [s for s in segments if self._task(s.req_id) == "token_embed"]
        if per_token:
            vectors = self._per_token(hidden, per_token)
            segments = [s for s in segments if self._task(s.req_id) != "token_embed"]
        if kind == "LAST":
            done = [s for s in segments if s.done]
            if done:
                index = torch.tensor([s.offset + s.num - 1 for s in done], device=hidden.device)
                rows = hidden[index].float()
                vectors = {s.req_id: rows[i] for i, s in enumerate(done)}
        else:
            for s in segments:
                if kind == "MEAN":
                    total, count = self.partial.get(s.req_id, (0.0, 0))
                    total = hidden[s.offset : s.offset + s.num].float().sum(dim=0) + total
                    self.partial[s.req_id] = (total, count + s.num)
                elif s.start == 0:  # CLS: the prompt's first position is in this chunk
                    self.partial[s.req_id] = (hidden[s.offset].float(), 1)
                if s.done:
                    total, count = self.partial.pop(s.req_id)
                    vectors[s.req_id] = total / count
        return {rid: self._finish(rid, vector) for rid, vector in vectors.items()}

    def _task(self, req_id: str) -> str:
        params = self.params.get(req_id)
        return params.task if params is not None else "embed"

    def _per_token(self, hidden: torch.Tensor, segments: list[PoolSegment]) -> dict[str, torch.Tensor]:
        """token_embed: each segment's rows join its request's; a finished prompt gets them all."""
        done: dict[str, torch.Tensor] = {}
        for s in segments:
            rows = self.token_rows.setdefault(s.req_id, [])
            rows.append(hidden[s.offset : s.offset + s.num].float())
            if s.done:
                done[s.req_id] = torch.cat(self.token_rows.pop(s.req_id))
        return done

    def _finish(self, req_id: str, vector: torch.Tensor) -> PooledTensor:
        params = self.params.get(req_id) or PoolingParams()
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = params.normalize if params.normalize is not None else (
            self.config.normalize and params.task in ("embed", "token_embed"))
        if normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
        values = vector.cpu().numpy().astype("<f4", copy=False)
        return PooledTensor(values.tobytes(), list(values.shape))

