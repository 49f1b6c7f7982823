"""The sampler on hand-made logits: each knob does what vLLM's does."""

from __future__ import annotations

import math

import torch

from compiled_llm.worker.sampler import Sampler, SamplingMetadata

V = 8


def meta(n: int, **kw) -> SamplingMetadata:
    temperature = kw.pop("temperature", None)
    if temperature is not None:
        kw["temperature"] = torch.tensor(temperature, dtype=torch.float32)
    return SamplingMetadata(all_greedy=temperature is None, **{"temperature": None, **kw})


def test_greedy_is_argmax():
    logits = torch.randn(3, V)
    out = Sampler()(logits, meta(3))
    assert out.sampled.tolist() == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(2, V)
    out = Sampler()(logits, meta(2, temperature=[0.0, 1.0]))
    assert out.sampled[0] == logits[0].argmax()


def test_top_k_one_is_greedy_and_top_k_restricts_support():
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    top3 = set(logits[0].topk(3).indices.tolist())
    s = Sampler()
    for _ in range(50):
        t = s(logits, meta(1, temperature=[5.0], top_k=torch.tensor([3]))).sampled.item()
        assert t in top3
    assert s(logits, meta(1, temperature=[5.0], top_k=torch.tensor([1]))).sampled.item() == logits.argmax().item()


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05, 1e-9, 1e-9, 1e-9]]))
    s = Sampler()
    seen = {s(logits, meta(1, temperature=[1.0], top_p=torch.tensor([0.75]))).sampled.item() for _ in range(200)}
    assert seen == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05, 1e-9, 1e-9, 1e-9, 1e-9]]))
    s = Sampler()
    seen = {s(logits, meta(1, temperature=[1.0], min_p=torch.tensor([0.2]))).sampled.item() for _ in range(200)}
    assert seen == {0, 1}


def test_seeded_rows_are_reproducible_and_independent_of_batch():
    logits = torch.zeros(2, 1000)
    def run(seed_rows):
        gens = {i: torch.Generator().manual_seed(123) for i in seed_rows}
        return Sampler()(logits, meta(2, temperature=[1.0, 1.0], generators=gens)).sampled.tolist()
    a, b = run([0, 1]), run([0, 1])
    assert a == b and a[0] == a[1]  # same seed, same stream
    c = run([0])
    assert c[0] == a[0]  # unseeded neighbours do not disturb a seeded row


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    counts = torch.zeros(1, V)
    counts[0, 0] = 3
    seen = torch.zeros(1, V, dtype=torch.bool)
    seen[0, 0] = seen[0, 2] = True
    m = meta(1, frequency_penalty=torch.tensor([0.5]), presence_penalty=torch.tensor([0.25]),
             output_token_counts=counts)
    out = Sampler.apply_penalties(logits.clone(), m)
    assert out[0, 0].item() == 2.0 - 1.5 - 0.25 and out[0, 1].item() == 2.0
    m = meta(1, repetition_penalty=torch.tensor([2.0]), seen_token_mask=seen)
    out = Sampler.apply_penalties(logits.clone(), m)
    assert out[0, 0].item() == 1.0 and out[0, 2].item() == -2.0 and out[0, 1].item() == 2.0


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[10.0] + [0.0] * (V - 1)])
    out = Sampler()(logits, meta(1, banned_rows=torch.tensor([0]), banned_token_ids=torch.tensor([0])))
    assert out.sampled.item() != 0


def test_logprobs_are_raw_with_rank_and_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    out = Sampler()(logits, meta(1, max_num_logprobs=2, presence_penalty=torch.tensor([2.0]),
                                 output_token_counts=torch.tensor([[0, 1.0, 0, 0, 0, 0, 0, 0]])))
    # The penalty makes token 2 the greedy pick; logprobs stay those of the raw logits.
    assert out.sampled.item() == 2
    raw = logits.log_softmax(-1)[0]
    assert out.logprob_token_ids[0].tolist() == [2, 1, 2]
    assert math.isclose(out.logprobs[0, 0].item(), raw[2].item(), rel_tol=1e-6)
    assert out.sampled_ranks.item() == 2
