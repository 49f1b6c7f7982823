"""From logits to tokens: logit bias, penalties, temperature, top-k / top-p / min-p, seeded sampling,
logprobs.

Every transformation works on the whole batch at once; a knob nobody in the batch uses costs
nothing (its tensor is None). Logprobs are those of the raw model output (after a grammar's
bitmask, which the runner applies first, and before logit bias and penalties), as vLLM returns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np
import torch

_EPS = 1e-5

# A request's own random stream: torch's on a GPU (Philox, seeded with all 64 bits); numpy's
# PCG64 on a CPU, where torch's generator (mt19937) keeps only the seed's low 32 bits.
SeededRNG = Union[torch.Generator, np.random.Generator]


def seeded_rng(seed: int, device: torch.device) -> SeededRNG:
    """A stream for an int64 `seed`: distinct seeds give distinct streams (two's complement maps
    every int64 to its own uint64, so -1 is not 2**63 - 1)."""
    seed64 = seed & 0xFFFF_FFFF_FFFF_FFFF
    if device.type == "cpu":
        return np.random.Generator(np.random.PCG64(seed64))
    generator = torch.Generator(device=device)
    generator.manual_seed(seed64)
    return generator


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [R]; None when every request is greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [R] int64, 0 = off
    top_p: torch.Tensor | None = None  # [R] float
    min_p: torch.Tensor | None = None  # [R] float
    generators: dict[int, SeededRNG] = field(default_factory=dict)  # batch index -> seeded RNG
    max_num_logprobs: int | None = None
    # Penalties: None when unused by the whole batch. They describe the rows `penalty_rows` of
    # the batch ([P] indices; None: every row), in that order.
    penalty_rows: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None  # [P]
    frequency_penalty: torch.Tensor | None = None  # [P]
    repetition_penalty: torch.Tensor | None = None  # [P]
    output_token_counts: torch.Tensor | None = None  # [P, V] counts of generated tokens
    seen_token_mask: torch.Tensor | None = None  # [P, V] prompt or generated (repetition penalty)
    # Tokens a row may not sample yet (EOS and stop tokens before min_tokens): pairs (row, id).
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None
    # logit_bias: a bias added to the logit of (row, token id) triples; None when nobody asks.
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_token_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    # logprob_token_ids: rows [C] whose alternatives are the token ids they chose ([C, k], each row's
    # ids padded with its last one), not the top k; None when nobody asks.
    chosen_logprob_rows: torch.Tensor | None = None
    chosen_logprob_ids: torch.Tensor | None = None
    # allowed_token_ids: rows [A] restricted to some tokens, and (index into those rows, token id)
    # pairs of what each may sample; None when nobody asks.
    allowed_rows: torch.Tensor | None = None
    allowed_at: torch.Tensor | None = None
    allowed_token_ids: torch.Tensor | None = None


_cpu_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None  # set once the C++ kernels are loaded


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of [rows, vocab] scores, the same indices (ties: the first; NaN counts
    as the largest). On a CPU the kernels' version: torch's is a scalar loop in an OpenMP region,
    14x slower a row than a vectorised max (kernels/csrc/cpu_argmax.cpp)."""
    global _cpu_argmax
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0:
        if _cpu_argmax is None and hasattr(torch.ops.compiled_llm_cpu, "argmax_rows"):
            _cpu_argmax = torch.ops.compiled_llm_cpu.argmax_rows  # loaded with a float32 CPU model's kernels
        if _cpu_argmax is not None:
            return _cpu_argmax(x)
    return x.argmax(dim=-1)


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
        sampled = self.sample(self.adjust_logits(logits, meta), meta)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        return self.gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs, meta)

    def adjust_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Logit bias, penalties and the tokens banned before min_tokens, on float32 logits (in place
        where it can): what greedy takes the argmax of."""
        if meta.logit_bias_rows is not None:
            logits.index_put_((meta.logit_bias_rows, meta.logit_bias_token_ids), meta.logit_bias_values,
                              accumulate=True)
        logits = self.apply_penalties(logits, meta)
        if meta.banned_rows is not None:
            logits[meta.banned_rows, meta.banned_token_ids] = float("-inf")
        if meta.allowed_rows is not None:  # every other token of those rows to -inf
            assert meta.allowed_at is not None and meta.allowed_token_ids is not None
            keep = torch.full((len(meta.allowed_rows), logits.shape[1]), float("-inf"), dtype=logits.dtype,
                              device=logits.device)
            keep[meta.allowed_at, meta.allowed_token_ids] = 0.0
            logits.index_add_(0, meta.allowed_rows, keep)
        return logits

    @staticmethod
    def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """vLLM's penalties on the rows that have them (only those rows are read and written)."""
        if meta.output_token_counts is None and meta.seen_token_mask is None:
            return logits
        rows = meta.penalty_rows
        part = logits if rows is None else logits.index_select(0, rows)
        if meta.repetition_penalty is not None and meta.seen_token_mask is not None:
            penalty = meta.repetition_penalty.unsqueeze(1)
            scaled = torch.where(part > 0, part / penalty, part * penalty)
            part = torch.where(meta.seen_token_mask, scaled, part)
        counts = meta.output_token_counts
        if counts is not None and meta.frequency_penalty is not None:
            part = part - meta.frequency_penalty.unsqueeze(1) * counts
        if counts is not None and meta.presence_penalty is not None:
            part = part - meta.presence_penalty.unsqueeze(1) * (counts > 0).to(part.dtype)
        if rows is None:
            return part
        return logits.index_copy(0, rows, part)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = argmax_rows(logits)
        if meta.all_greedy:
            return greedy
        assert meta.temperature is not None
        random = self.random_sample(self.target_probs(logits, meta), meta.generators)
        return torch.where(meta.temperature < _EPS, greedy, random)

    def target_probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution each non-greedy row samples from: temperature, then top-k / top-p / min-p
        (speculative decoding's rejection sampler keeps exactly this one)."""
        assert meta.temperature is not None
        temperature = meta.temperature
        logits = logits / torch.where(temperature < _EPS, 1.0, temperature).unsqueeze(1)
        logits = self.apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        if meta.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits.softmax(dim=-1)

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
    def random_sample(probs: torch.Tensor, generators: dict[int, SeededRNG]) -> torch.Tensor:
        """Gumbel-style sampling, `argmax(p / q)` with `q ~ Exp(1)`: no CPU sync, seeded per row."""
        q = torch.empty_like(probs)
        if len(generators) != probs.shape[0]:
            q.exponential_()
        for row, generator in generators.items():
            if isinstance(generator, np.random.Generator):
                noise = generator.standard_exponential(probs.shape[1], dtype=np.float32)
                q[row].copy_(torch.from_numpy(np.maximum(noise, np.float32(1e-30))))
            else:
                q[row].exponential_(generator=generator)
        return argmax_rows(probs.div(q))

    @staticmethod
    def gather_logprobs(
        raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int, meta: SamplingMetadata | None = None
    ) -> SamplerOutput:
        """The sampled token's logprob and rank, then k alternatives: the top k, or for the rows that
        chose theirs (`logprob_token_ids`) those tokens."""
        sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))
        ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
        if k > 0:
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
            if meta is not None and meta.chosen_logprob_rows is not None:
                assert meta.chosen_logprob_ids is not None
                rows, chosen = meta.chosen_logprob_rows, meta.chosen_logprob_ids[:, :k]
                top_ids[rows, : chosen.shape[1]] = chosen
                top_lp[rows, : chosen.shape[1]] = raw_logprobs[rows].gather(1, chosen)
            ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
            lps = torch.cat([sampled_lp, top_lp], dim=1)
        else:
            ids, lps = sampled.unsqueeze(1), sampled_lp
        return SamplerOutput(sampled, ids, lps, ranks)
