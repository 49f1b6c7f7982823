"""From logits to tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Every transformation works on the whole batch at once; a knob nobody in the batch uses costs
nothing (its tensor is None). Logprobs are those of the raw model output, as vLLM returns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_EPS = 1e-5


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [R]; None when every request is greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [R] int64, 0 = off
    top_p: torch.Tensor | None = None  # [R] float
    min_p: torch.Tensor | None = None  # [R] float
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # batch index -> seeded RNG
    max_num_logprobs: int | None = None
    # Penalties: None when unused by the whole batch.
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None  # [R, V] counts of generated tokens
    seen_token_mask: torch.Tensor | None = None  # [R, V] prompt or generated (repetition penalty)
    banned_token_ids: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, ids) e.g. EOS before min_tokens


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [R] int64
    logprob_token_ids: torch.Tensor | None = None  # [R, 1 + k]: sampled first
    logprobs: torch.Tensor | None = None  # [R, 1 + k]
    sampled_ranks: torch.Tensor | None = None  # [R]


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.apply_penalties(logits, meta)
        for row, ids in meta.banned_token_ids:
            logits[row, ids] = float("-inf")
        sampled = self.sample(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        return self.gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.repetition_penalty is not None and meta.seen_token_mask is not None:
            penalty = meta.repetition_penalty.unsqueeze(1)
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(meta.seen_token_mask, scaled, logits)
        counts = meta.output_token_counts
        if counts is not None:
            if meta.frequency_penalty is not None:
                logits = logits - meta.frequency_penalty.unsqueeze(1) * counts
            if meta.presence_penalty is not None:
                logits = logits - meta.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
        return logits

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        assert meta.temperature is not None
        temperature = meta.temperature
        is_greedy = temperature < _EPS
        logits = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
        logits = self.apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        if meta.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        probs = logits.softmax(dim=-1)
        random = self.random_sample(probs, meta.generators)
        return torch.where(is_greedy, greedy, random)

    @staticmethod
    def apply_top_k_top_p(
        logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor:
        if top_k is None and top_p is None:
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        vocab = logits.shape[-1]
        if top_k is not None:
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
            kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if top_p is not None:
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= (1 - top_p).unsqueeze(1)
            drop[:, -1] = False  # always keep the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return sorted_logits.scatter(-1, order, sorted_logits)

    @staticmethod
    def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """Gumbel-style sampling, `argmax(p / q)` with `q ~ Exp(1)`: no CPU sync, seeded per row."""
        q = torch.empty_like(probs)
        if len(generators) != probs.shape[0]:
            q.exponential_()
        for row, generator in generators.items():
            q[row].exponential_(generator=generator)
        return probs.div(q).argmax(dim=-1)

    @staticmethod
    def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> SamplerOutput:
        sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))
        ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
        if k > 0:
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
            ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
            lps = torch.cat([sampled_lp, top_lp], dim=1)
        else:
            ids, lps = sampled.unsqueeze(1), sampled_lp
        return SamplerOutput(sampled, ids, lps, ranks)
