"""The sampling metadata kept in rows (and the penalty counts kept incrementally on the device)
equal what a from-scratch build over each request's whole history gives, whatever the mix of
requests, their histories and the order they come and go in (Hypothesis)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_llm.messages.scheduler_output import NewRequestData
from compiled_llm.sampling_params import SamplingParams
from compiled_llm.worker.input_batch import InputBatch
from compiled_llm.worker.sampler import Sampler, seeded_rng

VOCAB = 32
EOS = [2]

params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([0, 3, 100]),
    top_p=st.sampled_from([1.0, 0.8]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    min_tokens=st.integers(0, 4),
    max_tokens=st.just(50),
    logprobs=st.sampled_from([None, 0, 3]),
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(3, VOCAB - 1), max_size=2),
)


def reference_logits(logits: torch.Tensor, requests: list[tuple[SamplingParams, list[int], int]]) -> torch.Tensor:
    """Penalties and min_tokens bans, built densely from each request's history (the old way)."""
    out = logits.clone()
    for i, (p, tokens, num_prompt) in enumerate(requests):
        row = out[i]
        generated = tokens[num_prompt:]
        if p.repetition_penalty != 1.0:
            for t in set(tokens):
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        counts = torch.zeros(VOCAB)
        for t in generated:
            counts[t] += 1
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if len(generated) < p.min_tokens:
            banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else EOS)
            row[banned] = float("-inf")
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(st.tuples(params_strategy, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
                      min_size=1, max_size=6),
    steps=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=6, max_size=6), max_size=5),
    drop=st.integers(0, 5),
)
def test_metadata_matches_a_build_from_the_whole_history(requests, steps, drop):
    batch = InputBatch(8, 64, 4, "cpu", VOCAB, EOS)
    history: dict[str, tuple[SamplingParams, list[int], int]] = {}
    for i, (params, prompt) in enumerate(requests):
        batch.add(NewRequestData(f"r{i}", list(prompt), len(prompt), params, [1], 0))
        history[f"r{i}"] = (params, list(prompt), len(prompt))
    for step, tokens in enumerate(steps):
        if step == 1 and len(history) > 1:  # a request leaves mid-way and its row is reused
            gone = sorted(history)[drop % len(history)]
            batch.remove(gone)
            del history[gone]
            params, prompt = requests[0]
            batch.add(NewRequestData("late", list(prompt), len(prompt), params, [1], 0))
            history["late"] = (params, list(prompt), len(prompt))
        ids = sorted(history)
        rows = np.array([batch.row_of[r] for r in ids])
        sampled = torch.tensor(tokens[: len(ids)])
        batch.sampling.record_sampled(rows, sampled)
        batch.append_tokens(rows, sampled.numpy())
        for rid, token in zip(ids, sampled.tolist()):
            history[rid][1].append(token)

    ids = sorted(history)
    rows = np.array([batch.row_of[r] for r in ids])
    meta = batch.sampling.metadata(rows, batch.num_output_tokens(rows))
    logits = torch.randn(len(ids), VOCAB)
    ours = Sampler.apply_penalties(logits.clone(), meta)
    if meta.banned_rows is not None:
        ours[meta.banned_rows, meta.banned_token_ids] = float("-inf")
    expected = reference_logits(logits, [history[r] for r in ids])
    torch.testing.assert_close(ours, expected)
    # The per-row knobs come back in the batch's order.
    temps = [history[r][0].temperature for r in ids]
    assert meta.all_greedy == all(t < 1e-5 for t in temps)
    if not meta.all_greedy:
        assert meta.temperature.tolist() == [float(np.float32(t)) for t in temps]
    wanted = [history[r][0].logprobs for r in ids if history[r][0].logprobs is not None]
    assert meta.max_num_logprobs == (max(wanted) if wanted else None)


def test_a_preempted_request_keeps_its_generator():
    batch = InputBatch(4, 64, 4, "cpu", VOCAB, EOS)
    params = SamplingParams(temperature=1.0, seed=7)
    batch.add(NewRequestData("a", [1, 2], 2, params, [1], 0))
    generator = batch.sampling.generators[batch.row_of["a"]]
    first = generator.standard_exponential(3)
    batch.remove("a", keep_sampling_state=True)
    batch.add(NewRequestData("a", [1, 2], 2, params, [1], 0))
    again = batch.sampling.generators[batch.row_of["a"]]
    assert again is generator  # it continues its stream, not a fresh copy of the seed
    fresh = seeded_rng(7, torch.device("cpu"))
    assert np.array_equal(fresh.standard_exponential(3), first)
    assert np.array_equal(again.standard_exponential(3), fresh.standard_exponential(3))


def test_every_int64_seed_is_its_own_stream():
    batch = InputBatch(4, 64, 4, "cpu", VOCAB, EOS)
    draws = []
    for i, seed in enumerate([-1, 2**63 - 1, 5, 5 + 2**63 - 2**64, -(2**63)]):
        batch.add(NewRequestData(f"s{i}", [1], 1, SamplingParams(temperature=1.0, seed=seed), [1], 0))
        generator = batch.sampling.generators[batch.row_of[f"s{i}"]]
        draws.append(tuple(generator.standard_exponential(4).tolist()))
        batch.remove(f"s{i}")
    assert len(set(draws)) == len(draws)


@settings(max_examples=30, deadline=None)
@given(chosen=st.lists(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)),
                       min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_logprob_token_ids_replace_the_top_k(chosen, seed):
    """Rows with logprob_token_ids return those ids' logprobs (their first `logprobs`), the others
    the top k, in one batch."""
    torch.manual_seed(seed)
    n = len(chosen)
    batch = InputBatch(8, 64, 4, "cpu", VOCAB, EOS)
    ks = [len(ids) if ids else 3 for ids in chosen]
    rows = []
    for i, ids in enumerate(chosen):
        params = SamplingParams(temperature=0.0, logprobs=ks[i], logprob_token_ids=ids)
        rows.append(batch.add(NewRequestData(f"r{i}", [5, 6], 2, params, [1], 0)))
    meta = batch.sampling.metadata(np.array(rows), np.zeros(n, dtype=np.int64))
    logits = torch.randn(n, VOCAB)
    out = Sampler()(logits, meta)
    raw = logits.log_softmax(-1)
    for i, ids in enumerate(chosen):
        got_ids = out.logprob_token_ids[i, 1 : 1 + ks[i]].tolist()
        expected = ids if ids else raw[i].topk(3).indices.tolist()
        assert got_ids == expected
        torch.testing.assert_close(out.logprobs[i, 1 : 1 + ks[i]], raw[i, expected])


@settings(max_examples=30, deadline=None)
@given(allowed=st.lists(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)),
                        min_size=1, max_size=5),
       temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**16))
def test_allowed_token_ids_restrict_sampling_but_not_logprobs(allowed, temperature, seed):
    """Rows with allowed_token_ids sample (greedy: the best) among those ids only; the others are
    untouched; logprobs are the model's own, from before the restriction (vLLM's raw logprobs)."""
    torch.manual_seed(seed)
    n = len(allowed)
    batch = InputBatch(8, 64, 4, "cpu", VOCAB, EOS)
    rows = [batch.add(NewRequestData(f"r{i}", [5, 6], 2, SamplingParams(temperature=temperature, logprobs=2,
                                                                          allowed_token_ids=ids), [1], 0))
            for i, ids in enumerate(allowed)]
    meta = batch.sampling.metadata(np.array(rows), np.zeros(n, dtype=np.int64))
    logits = torch.randn(n, VOCAB)
    raw = logits.log_softmax(-1)
    out = Sampler()(logits.clone(), meta)
    for i, ids in enumerate(allowed):
        token = int(out.sampled[i])
        if ids:
            assert token in ids
            if temperature == 0.0:
                assert token == max(ids, key=lambda t: (logits[i, t].item(), -t))
        elif temperature == 0.0:
            assert token == int(logits[i].argmax())
        torch.testing.assert_close(out.logprobs[i, 0], raw[i, token])
