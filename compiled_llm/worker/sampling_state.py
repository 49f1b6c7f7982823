"""Each running request's sampling settings, kept in rows and updated as the batch changes.

A step's `SamplingMetadata` is gathered from these rows with vectorised numpy and tensor indexing:
nothing is rebuilt per request per step. The token counts the penalties need live on the device,
one row per request (allocated the first time a request asks for a penalty), and grow by one
vectorised update per step with the tokens just sampled, instead of a dense `[requests, vocab]`
count rebuilt on the host from every request's history each step.
"""

from __future__ import annotations

import numpy as np
import torch

from compiled_llm.sampling_params import SamplingParams
from compiled_llm.worker.sampler import SamplingMetadata, SeededRNG, seeded_rng

_EPS = 1e-5


class SamplingState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.device = device  # where the logits, the counts and seeded generators live
        self.eos_token_ids = np.asarray(eos_token_ids, dtype=np.int64)
        n = max_num_reqs
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.presence_penalty = np.zeros(n, dtype=np.float32)
        self.frequency_penalty = np.zeros(n, dtype=np.float32)
        self.repetition_penalty = np.ones(n, dtype=np.float32)
        self.num_logprobs = np.full(n, -1, dtype=np.int64)  # -1: no logprobs
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.banned_until_min_tokens: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n
        # logit_bias: each row's token ids and the biases added to their logits.
        self.has_logit_bias = np.zeros(n, dtype=bool)
        self.logit_bias_ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n
        self.logit_bias_values: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * n
        # allowed_token_ids: the only tokens a row may sample (sorted, unique).
        self.has_allowed_ids = np.zeros(n, dtype=bool)
        self.allowed_ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n
        # logprob_token_ids: the tokens whose logprobs a row returns instead of the top k.
        self.has_chosen_logprobs = np.zeros(n, dtype=bool)
        self.chosen_logprob_ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n
        self.counts_tokens = np.zeros(n, dtype=bool)  # presence/frequency (counts) or repetition (seen)
        self.has_generator = np.zeros(n, dtype=bool)
        self.generators: dict[int, SeededRNG] = {}
        # Generators of preempted requests, by request id, until they come back or finish.
        self._parked_generators: dict[str, SeededRNG] = {}
        self.output_counts: torch.Tensor | None = None  # [rows, vocab] generated tokens, float32
        self.seen: torch.Tensor | None = None  # [rows, vocab] prompt or generated (repetition penalty)
        self._max_num_reqs = n

    # ---- rows in and out --------------------------------------------------------------------
    def add(self, row: int, req_id: str, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.temperature[row] = params.temperature
        greedy = params.temperature < _EPS
        self.top_k[row] = 0 if greedy else min(params.top_k, self.vocab_size)
        self.top_p[row] = 1.0 if greedy else params.top_p
        self.min_p[row] = 0.0 if greedy else params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        if params.logprob_token_ids:  # every one of them, whatever `logprobs` says (vLLM)
            self.num_logprobs[row] = len(params.logprob_token_ids)
        self.min_tokens[row] = params.min_tokens
        banned = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            banned += self.eos_token_ids.tolist()
        self.banned_until_min_tokens[row] = np.asarray(banned, dtype=np.int64)
        self.has_logit_bias[row] = bool(params.logit_bias)
        if params.logit_bias:
            self.logit_bias_ids[row] = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            self.logit_bias_values[row] = np.fromiter(params.logit_bias.values(), dtype=np.float32)
        self.has_allowed_ids[row] = bool(params.allowed_token_ids)
        if params.allowed_token_ids:
            self.allowed_ids[row] = np.unique(np.asarray(params.allowed_token_ids, dtype=np.int64))
        self.has_chosen_logprobs[row] = bool(params.logprob_token_ids)
        if params.logprob_token_ids:
            self.chosen_logprob_ids[row] = np.asarray(params.logprob_token_ids, dtype=np.int64)
        self.counts_tokens[row] = bool(
            params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
        )
        if self.counts_tokens[row]:
            self._start_counts(row, token_ids, num_prompt_tokens)
        generator = self._parked_generators.pop(req_id, None)
        if generator is None and params.seed is not None:
            generator = seeded_rng(params.seed, self.device)
        self.has_generator[row] = generator is not None
        if generator is not None:
            self.generators[row] = generator

    def _start_counts(self, row: int, token_ids: list[int], num_prompt_tokens: int) -> None:
        if self.output_counts is None:
            shape = (self._max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.seen is not None
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)
        counts = self.output_counts[row]
        counts.zero_()
        counts.index_add_(0, ids[num_prompt_tokens:], torch.ones(len(ids) - num_prompt_tokens, device=self.device))
        self.seen[row].zero_()
        self.seen[row, ids] = True

    def remove(self, row: int, req_id: str, keep_generator: bool) -> None:
        """Forget the row's settings. A preempted request (`keep_generator`) keeps its seeded
        generator for when it comes back: it must draw as if it had never been preempted."""
        generator = self.generators.pop(row, None)
        if keep_generator and generator is not None:
            self._parked_generators[req_id] = generator
        elif not keep_generator:
            self._parked_generators.pop(req_id, None)
        self.has_generator[row] = False
        self.counts_tokens[row] = False
        self.has_logit_bias[row] = False
        self.has_allowed_ids[row] = False
        self.has_chosen_logprobs[row] = False
        self.num_logprobs[row] = -1

    # ---- one step ---------------------------------------------------------------------------
    def record_sampled(self, rows: np.ndarray, sampled: torch.Tensor) -> None:
        """Count the tokens just sampled for `rows` (one each), for the requests with penalties."""
        which = np.flatnonzero(self.counts_tokens[rows])
        if not len(which):
            return
        assert self.output_counts is not None and self.seen is not None
        row_index = self._tensor(rows[which])
        tokens = sampled.index_select(0, self._tensor(which))
        self.output_counts.index_put_((row_index, tokens), torch.ones_like(tokens, dtype=torch.float32),
                                      accumulate=True)
        self.seen[row_index, tokens] = True

    def metadata(self, rows: np.ndarray, num_output_tokens: np.ndarray) -> SamplingMetadata:
        """What the sampler needs for the requests of `rows`, in that order; `num_output_tokens`
        is how many tokens each has generated so far (for `min_tokens`)."""
        temperature = self.temperature[rows]
        all_greedy = bool((temperature < _EPS).all())
        meta = SamplingMetadata(temperature=None if all_greedy else self._tensor(temperature), all_greedy=all_greedy)
        if not all_greedy:
            top_k = self.top_k[rows]
            if top_k.any():
                meta.top_k = self._tensor(top_k)
            top_p = self.top_p[rows]
            if (top_p < 1.0).any():
                meta.top_p = self._tensor(top_p)
            min_p = self.min_p[rows]
            if min_p.any():
                meta.min_p = self._tensor(min_p)
            seeded = np.flatnonzero(self.has_generator[rows])
            meta.generators = {int(i): self.generators[int(rows[i])] for i in seeded}
        num_logprobs = int(self.num_logprobs[rows].max(initial=-1))
        meta.max_num_logprobs = None if num_logprobs < 0 else num_logprobs
        self._penalties(rows, meta)
        choosing = np.flatnonzero(self.has_chosen_logprobs[rows])
        if len(choosing) and meta.max_num_logprobs:
            width = meta.max_num_logprobs
            chosen = [self.chosen_logprob_ids[int(rows[i])] for i in choosing]
            padded = np.stack([np.pad(ids, (0, width - len(ids)), mode="edge")[:width] for ids in chosen])
            meta.chosen_logprob_rows = self._tensor(choosing)
            meta.chosen_logprob_ids = self._tensor(padded)
        biased = np.flatnonzero(self.has_logit_bias[rows])
        if len(biased):
            biased_rows = rows[biased].tolist()
            ids = [self.logit_bias_ids[r] for r in biased_rows]
            meta.logit_bias_rows = self._tensor(np.repeat(biased, [len(x) for x in ids]))
            meta.logit_bias_token_ids = self._tensor(np.concatenate(ids))
            meta.logit_bias_values = self._tensor(np.concatenate([self.logit_bias_values[r] for r in biased_rows]))
        allowing = np.flatnonzero(self.has_allowed_ids[rows])
        if len(allowing):
            ids = [self.allowed_ids[int(rows[i])] for i in allowing]
            meta.allowed_rows = self._tensor(allowing)
            meta.allowed_at = self._tensor(np.repeat(np.arange(len(allowing)), [len(x) for x in ids]))
            meta.allowed_token_ids = self._tensor(np.concatenate(ids))
        banning = np.flatnonzero(num_output_tokens < self.min_tokens[rows])
        if len(banning):
            ids = [self.banned_until_min_tokens[int(rows[i])] for i in banning]
            lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
            if lengths.any():
                meta.banned_rows = self._tensor(np.repeat(banning, lengths))
                meta.banned_token_ids = self._tensor(np.concatenate(ids))
        return meta

    def _penalties(self, rows: np.ndarray, meta: SamplingMetadata) -> None:
        which = np.flatnonzero(self.counts_tokens[rows])
        if not len(which):
            return
        assert self.output_counts is not None and self.seen is not None
        penalised = rows[which]
        index = self._tensor(penalised)
        meta.penalty_rows = self._tensor(which)
        meta.output_token_counts = self.output_counts.index_select(0, index)
        presence, frequency = self.presence_penalty[penalised], self.frequency_penalty[penalised]
        if presence.any() or frequency.any():
            meta.presence_penalty = self._tensor(presence)
            meta.frequency_penalty = self._tensor(frequency)
        repetition = self.repetition_penalty[penalised]
        if (repetition != 1.0).any():
            meta.repetition_penalty = self._tensor(repetition)
            meta.seen_token_mask = self.seen.index_select(0, index)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)
