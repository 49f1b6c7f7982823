"""Per-request back-off: a request whose proposals keep being rejected stops being given any for a
while, so that speculation costs little where the text does not repeat itself.

Each verification updates a moving average of the share of a request's draft tokens accepted. When
it falls below `MIN_ACCEPTANCE`, the request decodes one token per step for a pause (8 steps, doubled
at each back-off in a row, at most 128), then tries again from an even start. Exactness does not
depend on it: it only decides whether drafts are proposed.
"""

from __future__ import annotations

MIN_ACCEPTANCE = 0.2
_WEIGHT = 0.5  # of the latest verification in the average
_FIRST_PAUSE, _LONGEST_PAUSE = 8, 128


class AcceptanceBackoff:
    __slots__ = ("acceptance", "pause_left", "next_pause")

    def __init__(self) -> None:
        self.acceptance = 1.0  # optimistic: a new request is given drafts
        self.pause_left = 0
        self.next_pause = _FIRST_PAUSE

    def may_propose(self) -> bool:
        """Called once per decode step of the request: False while it is paused."""
        if self.pause_left:
            self.pause_left -= 1
            return False
        return True

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.acceptance += _WEIGHT * (num_accepted / num_drafts - self.acceptance)
        if self.acceptance >= MIN_ACCEPTANCE:
            if num_accepted:
                self.next_pause = _FIRST_PAUSE
            return
        self.pause_left = self.next_pause
        self.next_pause = min(2 * self.next_pause, _LONGEST_PAUSE)
        self.acceptance = 0.5
