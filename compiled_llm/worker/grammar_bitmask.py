"""Structured outputs in the runner: the grammar bitmask applied to the logits of the rows that
have a grammar, after the compiled forward (the compiled pieces and CUDA graphs never see it), and
only in steps that sample a constrained request.

On a GPU xgrammar's kernel applies it. On a CPU its kernel is never called, whatever the dtype: it
tests one bit at a time (about five argmax passes over the logits at batch 32), and (xgrammar 0.2.9)
where every id below a `vocab_size` that is not a multiple of 32 is allowed and a bit above it in
the last word is clear (as xgrammar fills a row that allows everything), it writes a -inf one past
`vocab_size`: into the next row's first logit, or, on the last row, 4 bytes past the tensor's
allocation (heap corruption: glibc aborts or malloc segfaults later). Here numpy unpacks only the
bits below the width, and the logits are masked in place: float32 on its bit patterns with a few
vectorised integer operations (about two argmax passes), other dtypes with one masked_fill.
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
    if logits.device.type == "cpu":
        _mask_cpu(part, bitmask)
    else:
        import xgrammar as xgr

        bitmask = bitmask.to(logits.device)  # a blocking copy: the host buffer is refilled next step
        xgr.apply_token_bitmask_inplace(part, bitmask, vocab_size=min(part.shape[-1], bitmask.shape[-1] * 32))
    if index is not None:
        logits.index_copy_(0, index, part)


def _mask_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[:, :width] = allowed ? logits : -inf; float32 on its bit patterns: (x & keep) | (-inf & ~keep)."""
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, count=width, bitorder="little")
    if logits.dtype != torch.float32:
        logits[:, :width].masked_fill_(torch.from_numpy(bits == 0), float("-inf"))
        return
    banned = torch.from_numpy(bits).to(torch.int32).sub_(1)  # -1 (all bits set) where forbidden, else 0
    as_int = logits[:, :width].view(torch.int32)
    as_int.bitwise_and_(banned.bitwise_not()).bitwise_or_(banned.bitwise_and_(_NEG_INF_BITS))
