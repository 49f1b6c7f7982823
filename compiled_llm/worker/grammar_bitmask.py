"""Structured outputs in the runner: the grammar bitmask applied to the logits of the rows that
have a grammar, after the compiled forward (the compiled pieces and CUDA graphs never see it), and
only in steps that sample a constrained request.

On a GPU xgrammar's kernel applies it. On a CPU its kernel tests one bit at a time (about five
argmax passes over the logits at batch 32); here the bits are unpacked by numpy and the logits'
float bits are masked with a few vectorised integer operations instead (about two).
"""

from __future__ import annotations

import numpy as np
import torch

_NEG_INF_BITS = int(torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32))


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits that bitmask row i forbids in logits row `rows[i]`
    (xgrammar's packed bits, one per token id, lowest bit first; a padded vocabulary's extra ids
    are forbidden by xgrammar, ids past the bitmask are left alone)."""
    every_row = rows == list(range(logits.shape[0]))
    index = None if every_row else torch.tensor(rows, dtype=torch.int64, device=logits.device)
    part = logits if index is None else logits.index_select(0, index)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        _mask_float32(part, bitmask)
    else:
        import xgrammar as xgr

        bitmask = bitmask.to(logits.device)  # a blocking copy: the host buffer is refilled next step
        xgr.apply_token_bitmask_inplace(part, bitmask, vocab_size=min(part.shape[-1], bitmask.shape[-1] * 32))
    if index is not None:
        logits.index_copy_(0, index, part)


def _mask_float32(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits = allowed ? logits : -inf, on the float32 bit patterns: (x & keep) | (-inf & ~keep)."""
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=width, bitorder="little")
    banned = torch.from_numpy(bits).to(torch.int32).sub_(1)  # -1 (all bits set) where forbidden, else 0
    as_int = logits[:, :width].view(torch.int32)
    as_int.bitwise_and_(banned.bitwise_not()).bitwise_or_(banned.bitwise_and_(_NEG_INF_BITS))
