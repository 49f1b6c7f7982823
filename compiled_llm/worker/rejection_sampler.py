"""Speculative decoding's verification: which proposed tokens the target model accepts, and the
token after them.

A request verified in a step has 1 + n logits rows: one per proposed (draft) token and the bonus
row after the last. Drafts are accepted left to right:

- greedy: while the draft is the argmax of its row (after logit bias and min_tokens' bans), so the
  output is token for token greedy decoding's;
- sampling: a draft d is accepted with probability p(d), p being the row's target distribution
  (temperature, top-k, top-p, min-p: `Sampler.target_probs`). On the first rejection the token is
  drawn from p with d removed and renormalised. This is the standard rule for a proposal that puts
  all its mass on d (min(1, p/q) with q a point mass): the token at every position has exactly the
  distribution p, whatever was proposed.

When all n are accepted, the bonus token is drawn from the last row, as a step without drafts would
draw it. A seeded request draws its n uniforms and then one exponential vector from its own stream,
so its outputs repeat from run to run; with no drafts it draws exactly what `Sampler` would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compiled_llm.worker.sampler import _EPS, Sampler, SamplingMetadata, SeededRNG, argmax_rows


@dataclass
class RejectionOutput:
    """`tokens[i]`: request i's output tokens (accepted drafts, then one more), padded with -1.
    The logprob tensors have one row per logits row (position) of the step, as `SamplerOutput`'s."""

    tokens: torch.Tensor  # [R, 1 + max n] int64
    logprob_token_ids: torch.Tensor | None = None  # [N, 1 + k]: the output token at that position first
    logprobs: torch.Tensor | None = None  # [N, 1 + k]
    sampled_ranks: torch.Tensor | None = None  # [N]


def greedy_verdict(greedy: np.ndarray, num_drafts: np.ndarray, draft_ids: np.ndarray) -> np.ndarray:
    """Greedy verification on the host: `greedy` [sum(1 + n_i)] each position's argmax, `draft_ids`
    [sum n_i]; request i's tokens are its drafts up to the first that is not its row's argmax, then
    that row's argmax, padded with -1 (as `RejectionSampler` gives them). On a CPU this is what a
    greedy verification costs after the argmax: the tensor version's dozen small ops took 0.4 ms a
    step at batch 1, about 3% of the step."""
    width = int(num_drafts.max(initial=0)) + 1
    tokens = np.full((len(num_drafts), width), -1, dtype=np.int64)
    start = first_draft = 0
    for i, n in enumerate(num_drafts.tolist()):
        miss = np.flatnonzero(greedy[start : start + n] != draft_ids[first_draft : first_draft + n])
        accepted = int(miss[0]) if len(miss) else n
        tokens[i, : accepted + 1] = greedy[start : start + accepted + 1]  # accepted drafts are their rows' argmax
        start += n + 1
        first_draft += n
    return tokens


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        num_drafts: np.ndarray,
        draft_ids: torch.Tensor,
        generators: dict[int, SeededRNG],
    ) -> RejectionOutput:
        """`logits`: [sum(1 + n_i), V], request i's rows together, its draft rows first; `meta`
        describes those rows (one per position); `num_drafts`: n_i; `draft_ids`: [sum n_i] the
        drafts in the same order; `generators`: request index -> its seeded stream."""
        device = logits.device
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.sampler.adjust_logits(logits, meta)
        greedy = argmax_rows(logits)
        if meta.all_greedy and raw_logprobs is None and device.type == "cpu":
            return RejectionOutput(torch.from_numpy(greedy_verdict(greedy.numpy(), num_drafts, draft_ids.numpy())))
        num_reqs = len(num_drafts)
        counts = num_drafts + 1
        starts = np.cumsum(counts) - counts
        draft_req = np.repeat(np.arange(num_reqs), num_drafts)
        draft_j = np.arange(int(num_drafts.sum())) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
        draft_pos = torch.from_numpy(starts[draft_req] + draft_j).to(device)

        probs = None
        accept = greedy[draft_pos] == draft_ids
        if not meta.all_greedy:
            assert meta.temperature is not None
            probs = self.sampler.target_probs(logits, meta)
            uniforms = self._uniforms(num_drafts, generators, device)
            by_chance = uniforms < probs[draft_pos, draft_ids]
            accept = torch.where(meta.temperature[draft_pos] < _EPS, accept, by_chance)

        # Accepted drafts per request: up to its first rejection.
        draft_req_t = torch.from_numpy(draft_req).to(device)
        draft_j_t = torch.from_numpy(draft_j).to(device)
        num_accepted = torch.from_numpy(num_drafts.copy()).to(device)
        rejected = ~accept
        num_accepted.scatter_reduce_(0, draft_req_t[rejected], draft_j_t[rejected], reduce="amin")
        final_pos = torch.from_numpy(starts).to(device) + num_accepted
        final = greedy[final_pos]
        if probs is not None:
            final = self._sample_final(probs, final, final_pos, num_accepted, num_drafts, draft_ids, meta, generators)

        width = int(num_drafts.max(initial=0)) + 1
        tokens = torch.full((num_reqs, width), -1, dtype=torch.int64, device=device)
        keep = draft_j_t < num_accepted[draft_req_t]
        tokens[draft_req_t[keep], draft_j_t[keep]] = draft_ids[keep]
        tokens[torch.arange(num_reqs, device=device), num_accepted] = final
        if raw_logprobs is None:
            return RejectionOutput(tokens)
        # The output token at each position (clamped where a position yields none: its row is dropped).
        pos_req = torch.from_numpy(np.repeat(np.arange(num_reqs), counts)).to(device)
        pos_j = torch.from_numpy(np.arange(int(counts.sum())) - np.repeat(starts, counts)).to(device)
        at_pos = tokens[pos_req, pos_j].clamp(min=0)
        assert meta.max_num_logprobs is not None
        lp = self.sampler.gather_logprobs(raw_logprobs, at_pos, meta.max_num_logprobs, meta)
        return RejectionOutput(tokens, lp.logprob_token_ids, lp.logprobs, lp.sampled_ranks)

    def _sample_final(
        self,
        probs: torch.Tensor,
        greedy_final: torch.Tensor,
        final_pos: torch.Tensor,
        num_accepted: torch.Tensor,
        num_drafts: np.ndarray,
        draft_ids: torch.Tensor,
        meta: SamplingMetadata,
        generators: dict[int, SeededRNG],
    ) -> torch.Tensor:
        """Each request's token after its accepted drafts: from p without the rejected draft, or
        the bonus from the last row's p."""
        assert meta.temperature is not None
        device = probs.device
        p = probs[final_pos]
        num_drafts_t = torch.from_numpy(num_drafts).to(device)
        was_rejected = num_accepted < num_drafts_t
        if bool(was_rejected.any()):
            first_draft = torch.from_numpy(np.cumsum(num_drafts) - num_drafts).to(device)
            which = torch.nonzero(was_rejected).squeeze(1)
            rejected_ids = draft_ids[first_draft[which] + num_accepted[which]]
            without = p[which].index_put((torch.arange(len(which), device=device), rejected_ids),
                                         torch.zeros((), device=device))
            # A rejected draft held all the mass only by rounding: keep p as it is then.
            has_mass = without.sum(dim=-1, keepdim=True) > 0
            p[which] = torch.where(has_mass, without, p[which])
        random = self.sampler.random_sample(p, generators)
        return torch.where(meta.temperature[final_pos] < _EPS, greedy_final, random)

    @staticmethod
    def _uniforms(num_drafts: np.ndarray, generators: dict[int, SeededRNG], device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per draft; a seeded request's from its own stream."""
        total = int(num_drafts.sum())
        uniforms = torch.rand(total, device=device)
        starts = np.cumsum(num_drafts) - num_drafts
        for i, generator in generators.items():
            n = int(num_drafts[i])
            if not n:
                continue
            if isinstance(generator, np.random.Generator):
                values = torch.from_numpy(generator.random(n, dtype=np.float32))
            else:
                values = torch.rand(n, generator=generator, device=device)
            uniforms[int(starts[i]) : int(starts[i]) + n] = values.to(device)
        return uniforms
