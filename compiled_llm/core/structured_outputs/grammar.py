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

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in a row from here, the grammar allows (a speculative draft is
        cut there: a verification would reject the rest). The matcher is left as it was."""
        count = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            count += 1
        if count:
            self.matcher.rollback(count)
        return count

    def fill_bitmasks(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts): the tokens allowed at each position a verification
        samples, after each prefix of `drafts` (which `valid_prefix` vouched for). After a draft
        that ends the grammar anything goes: the request stops there and later tokens are dropped."""
        self.fill_bitmask(bitmask, row)
        for j, token in enumerate(drafts, 1):
            accepted = self.matcher.accept_token(token)
            assert accepted, f"draft token {token} outside the grammar"
            if self.matcher.is_terminated():
                bitmask[row + j : row + len(drafts) + 1].fill_(-1)
                self.matcher.rollback(j)
                return
            self.fill_bitmask(bitmask, row + j)
        if drafts:
            self.matcher.rollback(len(drafts))


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


def fill_grammar_bitmask(grammars: Sequence[RequestGrammar | None], out: torch.Tensor,
                         drafts: Sequence[list[int]] | None = None) -> torch.Tensor:
    """The rows of grammar i, in order: one, the tokens it allows next, or with `drafts[i]` one
    per verified position (`RequestGrammar.fill_bitmasks`); every token for None or an ended
    grammar, whose request is finishing and whose samples are dropped. Returns the filled rows."""
    drafts = drafts or [[] for _ in grammars]
    rows = out[: sum(1 + len(d) for d in drafts)]
    row = 0
    for grammar, draft in zip(grammars, drafts):
        if grammar is None or grammar.terminated:
            rows[row : row + 1 + len(draft)].fill_(-1)
        else:
            grammar.fill_bitmasks(rows, row, draft)
        row += 1 + len(draft)
    return rows
