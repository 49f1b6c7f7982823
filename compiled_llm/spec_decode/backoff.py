"""Per-request back-off: a request whose proposals keep being rejected stops being given any for a
while, so that speculation costs little where the text does not repeat itself; and the number of
drafts a request is given follows how many it has been getting right.

Each verification updates a moving average of the share of a request's draft tokens accepted. When
it falls below `MIN_ACCEPTANCE`, the request decodes one token per step for a pause (8 steps, doubled
at each back-off in a row, at most 128), then tries again from an even start.

Draft length: a verification costs about one row of compute per draft on a CPU (the weights are
read once, but every row is multiplied), so long drafts pay only where they are accepted. A request
starts at `FIRST_LENGTH` drafts (or fewer, where num_speculative_tokens is lower); every draft of a
full-length proposal accepted doubles its length (up to num_speculative_tokens), and a rejection
sets it to one more than were accepted. A loop or a long copy soon verifies the whole
num_speculative_tokens a step; prose that matches its context in short runs stays at 2-3.

The acceptance a request needs grows with the batch where a verified row costs compute (a CPU): a
draft costs one row, and an accepted one saves its request's share of a step (`step_cost.py`, which
measures a step's fixed cost F in rows as the engine runs), so at B requests drafts pay while the
share accepted exceeds B / (B + F) (`min_acceptance`). A request that keeps long runs (a copy)
speculates at any batch; one matching in short runs stops where its drafts cost more than they save.
Where that bar is above one half, untried drafts (a request's first, or the first after a pause)
are probed one at a time, and only matches of the whole `prompt_lookup_max` tokens propose
(`shortest_match`): a first draft from a 2-token match of the bundled model landed 38-56% of the
time, from a 4-token match 75-94% (both workloads of benchmarks/spec_decode.py, 1 and 32 requests).

Exactness depends on none of this: it only decides how many drafts are proposed.
"""

from __future__ import annotations

MIN_ACCEPTANCE = 0.2
_WEIGHT = 0.5  # of the latest verification in the average
_FIRST_PAUSE, _LONGEST_PAUSE = 8, 128
FIRST_LENGTH, _LONGEST = 4, 64
MOST_NEEDED = 0.95  # a request whose drafts all land keeps proposing, whatever the fit says
# Where drafts must land more often than this to pay (a large batch on a CPU), a request whose
# drafts are untried (its first proposal, or the first after a pause) proposes one: a probe
# costs one row, where k drafts of prose cost k rows for a third of a token.
PROBE_ABOVE = 0.5


def min_acceptance(batch: int, step_fixed_rows: float | None) -> float:
    """The share of drafts a request must get accepted to keep proposing at `batch` requests a step,
    given a step's fixed cost in rows (`StepCost.fixed_rows`); None (not measured, or rows next to
    free: a GPU) keeps `MIN_ACCEPTANCE`."""
    if step_fixed_rows is None:
        return MIN_ACCEPTANCE
    return min(max(MIN_ACCEPTANCE, batch / (batch + step_fixed_rows)), MOST_NEEDED)


def shortest_match(needed: float, lookup_min: int, lookup_max: int) -> int:
    """The fewest tokens an n-gram match must have for its drafts to be proposed, at a bar of
    `needed`: all of `lookup_max` where more than half of the drafts must land, `lookup_min` below."""
    return lookup_max if needed > PROBE_ABOVE else lookup_min


class AcceptanceBackoff:
    __slots__ = ("acceptance", "pause_left", "next_pause", "length")

    def __init__(self) -> None:
        self.acceptance = 1.0  # optimistic: a new request is given drafts
        self.pause_left = 0
        self.next_pause = _FIRST_PAUSE
        self.length = FIRST_LENGTH  # drafts to propose next, before num_speculative_tokens caps it

    def probe(self, needed: float) -> None:
        """Before a request's first proposal: at a bar above `PROBE_ABOVE`, start with one draft
        (it doubles while all land)."""
        if needed > PROBE_ABOVE:
            self.length = 1

    def may_propose(self) -> bool:
        """Called once per decode step of the request: False while it is paused."""
        if self.pause_left:
            self.pause_left -= 1
            return False
        return True

    def record(self, num_drafts: int, num_accepted: int, needed: float = MIN_ACCEPTANCE) -> None:
        """One verification's outcome; `needed`: the acceptance below which the request pauses
        (`min_acceptance` at the step's batch)."""
        if num_accepted < num_drafts:
            self.length = num_accepted + 1
        elif num_drafts >= self.length:  # a shorter proposal (the context ran out) says nothing more
            self.length = min(2 * self.length, _LONGEST)
        self.acceptance += _WEIGHT * (num_accepted / num_drafts - self.acceptance)
        if self.acceptance >= needed:
            if num_accepted:
                self.next_pause = _FIRST_PAUSE
            return
        self.pause_left = self.next_pause
        self.next_pause = min(2 * self.next_pause, _LONGEST_PAUSE)
        self.acceptance = max(0.5, needed)  # the next try starts even: one good verification keeps it going
        self.probe(needed)
