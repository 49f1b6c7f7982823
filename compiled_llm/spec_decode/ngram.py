"""N-gram (prompt lookup) proposals from a request's own tokens, kept in an index per request.

The index maps every n-gram of the request's tokens (for each n in [min_n, max_n]) to where the
token after its latest occurrence sits. It grows by one entry per n as each token is appended, so a
proposal is a handful of dict lookups: no step scans the whole context. The last n tokens of the
request are looked up from the longest n down: the first hit proposes the k tokens that followed
that earlier occurrence. Where the context ends before k tokens followed it, the text is taken to
repeat with the period it has shown (the occurrence's distance from the end), as a copy would: a
generation stuck in a loop of d tokens gets k drafts, not d.
"""

from __future__ import annotations


class NgramIndex:
    """One request's n-gram index. `extend` with every token the request gets, in order."""

    __slots__ = ("min_n", "max_n", "tokens", "_last_start")

    def __init__(self, min_n: int, max_n: int, tokens: list[int] | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> index of the token that followed its latest occurrence.
        self._last_start: dict[tuple[int, ...], int] = {}
        if tokens:
            self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens: each new token registers the n-grams that end just before it."""
        tokens, index = self.tokens, self._last_start
        for token in new_tokens:
            end = len(tokens)  # the new token's index: what follows the n-grams ending at end - 1
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index[tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def propose(self, k: int, shortest: int | None = None) -> list[int]:
        """The `k` tokens that followed the latest earlier occurrence of the longest suffix n-gram,
        repeated with their period where the context ends first; [] without an occurrence.
        `shortest`: the shortest match to propose from (min_n if None or lower)."""
        tokens = self.tokens
        length = len(tokens)
        for n in range(min(self.max_n, length), max(self.min_n, shortest or 0) - 1, -1):
            start = self._last_start.get(tuple(tokens[length - n :]))
            if start is not None:
                if start + k <= length:
                    return tokens[start : start + k]
                period = tokens[start:]  # never empty: an occurrence is registered once a token follows it
                return (period * (k // len(period) + 1))[:k]
        return []
