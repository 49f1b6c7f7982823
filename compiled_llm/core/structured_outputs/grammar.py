"""One request's place in its grammar, and the step's bitmask of allowed tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from compiled_llm.logger import init_logger

if TYPE_CHECKING:
    import xgrammar as xgr

logger = init_logger(__name__)


class RequestGrammar:
    """A matcher over a compiled grammar, advanced by every token the request accepts. It ends
    (`terminated`) when the grammar is complete and a stop token was accepted, or when a token
    outside the grammar arrives (which the bitmask prevents; it is logged, never ignored)."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.terminated = False
        self.rejected_token: int | None = None

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance by `token_id`; False if the grammar does not allow it."""
        if self.terminated:
            return True
        if not self.matcher.accept_token(token_id):
            logger.warning("Request %s: token %d is outside its grammar; the request stops.", request_id, token_id)
            self.rejected_token, self.terminated = token_id, True
            return False
        self.terminated = self.matcher.is_terminated()
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


def fill_grammar_bitmask(grammars: Sequence[RequestGrammar | None], out: torch.Tensor) -> torch.Tensor:
    """Row i of `out`: the tokens grammar i allows next (every token for None or an ended grammar,
    whose request is finishing and whose sample is dropped). Returns the filled rows."""
    rows = out[: len(grammars)]
    for row, grammar in enumerate(grammars):
        if grammar is None or grammar.terminated:
            rows[row].fill_(-1)
        else:
            grammar.fill_bitmask(rows, row)
    return rows
