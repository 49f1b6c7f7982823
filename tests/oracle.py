"""The correctness oracle: HF transformers on the same weights, compared the way vLLM compares.

Greedy tokens must match; where they part, each side's token must be among the other side's
top-5 log probabilities at that position (after that the sequences may diverge).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP = 5


@dataclass
class GreedyRun:
    token_ids: list[int]
    top_ids: list[list[int]]  # per position, the top-5 token ids


def hf_greedy(model_path: str, prompts_ids: list[list[int]], max_new_tokens: int) -> list[GreedyRun]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    runs = []
    with torch.inference_mode():
        for ids in prompts_ids:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            tops = [logits[0].log_softmax(-1).topk(TOP).indices.tolist() for logits in out.logits]
            runs.append(GreedyRun(tokens, tops))
    return runs


def ours_greedy(outputs) -> list[GreedyRun]:
    """From `RequestOutput`s generated with temperature 0 and logprobs >= 5."""
    runs = []
    for out in outputs:
        c = out.outputs[0]
        tops = [[tid for tid, lp in sorted(pos.items(), key=lambda kv: kv[1].rank or 0) if lp.rank and lp.rank <= TOP]
                for pos in c.logprobs]
        runs.append(GreedyRun(list(c.token_ids), tops))
    return runs


def check_close(ours: list[GreedyRun], theirs: list[GreedyRun], name_a: str = "ours", name_b: str = "hf") -> int:
    """Assert the vLLM closeness rule; returns how many sequences matched exactly."""
    exact = 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a.token_ids) == len(b.token_ids), f"prompt {i}: lengths {len(a.token_ids)} vs {len(b.token_ids)}"
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                where = f"prompt {i} pos {pos}"
                assert ta in b.top_ids[pos], f"{where}: {name_a} token {ta} not in {name_b} top-5 {b.top_ids[pos]}"
                assert tb in a.top_ids[pos], f"{where}: {name_b} token {tb} not in {name_a} top-5 {a.top_ids[pos]}"
                break
        else:
            exact += 1
    return exact
