"""The rejection sampler keeps the target distribution: whatever is proposed, the token at each
position is distributed as the target says (chi-square over many fixed-seed samples), greedy
accepts exactly the argmax, and a seeded request draws the same tokens every time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from compiled_llm.worker.rejection_sampler import RejectionSampler, greedy_verdict
from compiled_llm.worker.sampler import Sampler, SamplingMetadata, seeded_rng

V = 8


def verify(logits_per_pos: torch.Tensor, drafts: list[int], num_reqs: int, temperature: float = 1.0,
           top_k: int = 0, generators=None):
    """`num_reqs` identical requests, each proposing `drafts` against rows `logits_per_pos`."""
    n = len(drafts)
    logits = logits_per_pos.repeat(num_reqs, 1)
    rows = num_reqs * (n + 1)
    meta = SamplingMetadata(temperature=torch.full((rows,), temperature), all_greedy=temperature == 0.0)
    if top_k:
        meta.top_k = torch.full((rows,), top_k)
    if meta.all_greedy:
        meta.temperature = None
    draft_ids = torch.tensor(drafts * num_reqs, dtype=torch.int64)
    num_drafts = np.full(num_reqs, n, dtype=np.int64)
    return RejectionSampler(Sampler())(logits, meta, num_drafts, draft_ids, generators or {}).tokens


def target(logits: torch.Tensor, top_k: int = 0) -> np.ndarray:
    if top_k:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.softmax(-1).double().numpy()


def assert_distributed_as(samples: np.ndarray, probs: np.ndarray) -> None:
    counts = np.bincount(samples, minlength=V)
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support"
    expected = probs[support] * len(samples)
    assert chisquare(counts[support], expected * counts[support].sum() / expected.sum()).pvalue > 1e-3


@pytest.mark.parametrize("top_k", [0, 4])
def test_every_position_keeps_the_target_distribution(top_k):
    torch.manual_seed(0)
    logits = torch.randn(4, V) * 1.5
    drafts = [int(logits[0].argmax()), int(logits[1].argsort()[-2]), 3]  # likely, plausible, maybe outside top-k
    tokens = verify(logits, drafts, 40000, top_k=top_k).numpy()
    assert_distributed_as(tokens[:, 0], target(logits[0], top_k))
    # Position j's token (given drafts 0..j-1 accepted) follows row j's target.
    for j in range(1, 4):
        accepted = (tokens[:, :j] == np.array(drafts[:j])).all(axis=1)
        assert accepted.sum() > 500
        assert_distributed_as(tokens[accepted, j], target(logits[j], top_k))
    # After the first rejection nothing follows.
    rejected = tokens[:, 0] != drafts[0]
    assert (tokens[rejected, 1:] == -1).all()


def test_greedy_accepts_exactly_the_argmax():
    logits = torch.randn(4, V)
    best = [int(r.argmax()) for r in logits]
    assert verify(logits, best[:3], 1, temperature=0.0).tolist() == [best]
    wrong = (best[1] + 1) % V
    assert verify(logits, [best[0], wrong, best[2]], 1, temperature=0.0).tolist() == [[best[0], best[1], -1, -1]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_greedy_verdict_on_the_host_equals_the_tensor_rule(drafts_per_req, seed):
    """The CPU's host-side greedy verdict (taken when no logprobs are wanted) against the rule read
    literally, and against the tensor path (taken when logprobs are): the same tokens."""
    rng = np.random.default_rng(seed)
    num_drafts = np.array([len(d) for d in drafts_per_req], dtype=np.int64)
    logits = torch.from_numpy(rng.normal(size=(int(num_drafts.sum() + len(num_drafts)), 4)).astype(np.float32))
    best = logits.argmax(-1).tolist()
    expected, row = [], 0
    for drafts in drafts_per_req:  # drafts from 0..3: often the argmax, often not
        out = []
        for j, d in enumerate(drafts):
            if d != best[row + j]:
                break
            out.append(d)
        out.append(best[row + len(out)])
        expected.append(out + [-1] * (int(num_drafts.max()) + 1 - len(out)))
        row += len(drafts) + 1
    draft_ids = torch.tensor([d for drafts in drafts_per_req for d in drafts], dtype=torch.int64)
    assert greedy_verdict(logits.argmax(-1).numpy(), num_drafts, draft_ids.numpy()).tolist() == expected
    sampler = RejectionSampler(Sampler())
    for logprobs in (None, 1):
        meta = SamplingMetadata(temperature=None, all_greedy=True, max_num_logprobs=logprobs)
        assert sampler(logits.clone(), meta, num_drafts, draft_ids, {}).tokens.tolist() == expected


def test_seeded_requests_repeat_and_without_drafts_sample_as_the_sampler():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    runs = [verify(logits, [1, 2], 4, generators={i: seeded_rng(100 + i, torch.device("cpu")) for i in range(4)})
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    # No drafts: the same draw as the plain sampler's from the same seeded stream.
    meta = SamplingMetadata(temperature=torch.ones(1), all_greedy=False,
                            generators={0: seeded_rng(7, torch.device("cpu"))})
    plain = Sampler()(logits[:1].clone(), meta).sampled
    spec = verify(logits[:1], [], 1, generators={0: seeded_rng(7, torch.device("cpu"))})
    assert spec.tolist() == [[int(plain)]]
