"""Structured outputs in the runner: the grammar bitmask applied to the logits of the rows that
have a grammar, after the compiled forward (the compiled pieces and CUDA graphs never see it), and
only in steps that sample a constrained request."""

from __future__ import annotations

import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits that bitmask row i forbids in logits row `rows[i]`
    (xgrammar's packed bits, one per token id; a padded vocabulary's extra ids are forbidden by
    xgrammar, ids past the bitmask are left alone)."""
    import xgrammar as xgr

    bitmask = bitmask.to(logits.device)  # a blocking copy: the host buffer is refilled next step
    vocab_size = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if rows == list(range(logits.shape[0])):
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    part = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(part, bitmask, vocab_size=vocab_size)
    logits.index_copy_(0, index, part)
