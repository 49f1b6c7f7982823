"""What a decode step's rows cost on this machine, measured as the engine runs: how large a share of
its drafts a request needs accepted for them to pay at a batch size.

A draft costs a row of the step's compute; an accepted one saves its request a step: the step's
fixed part spread over the batch, plus its own row. Fitting decode-only steps' times to a + b * rows
(a moving least-squares fit; a step's time runs from its start to the next one's, so that
scheduling and handing the outputs on count) gives that fixed part in rows, F = a / b, and at B requests drafts pay
while the share accepted exceeds B / (B + F) (`backoff.min_acceptance`). On a 2-core CPU with the
bundled model F is about 3-4 (a one-token step 8.5 ms, each further verified row about 2 ms): 20% of
drafts must land alone, 89% at 32 requests. Where rows cost next to nothing (a tiny model) F is large
and the bar stays at `backoff.MIN_ACCEPTANCE`.
"""

from __future__ import annotations

MIN_STEPS = 16  # decode steps observed before the fit is used
MIN_ROWS_VARIANCE = 0.25  # below this the steps' rows say nothing of a row's cost: the last fit stands
_WEIGHT = 0.05  # of the latest step in the moving moments (about the last 20 steps)


class StepCost:
    __slots__ = ("steps", "_rows", "_seconds", "_rows_sq", "_rows_seconds", "_fixed_rows")

    def __init__(self) -> None:
        self.steps = 0
        self._rows = self._seconds = self._rows_sq = self._rows_seconds = 0.0
        self._fixed_rows: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` query tokens (one per request, plus its drafts) took `seconds`."""
        w = 1.0 / (self.steps + 1) if self.steps < 1.0 / _WEIGHT else _WEIGHT  # plain means until the window fills
        self._rows += w * (rows - self._rows)
        self._seconds += w * (seconds - self._seconds)
        self._rows_sq += w * (rows * rows - self._rows_sq)
        self._rows_seconds += w * (rows * seconds - self._rows_seconds)
        self.steps += 1
        variance = self._rows_sq - self._rows * self._rows
        if self.steps < MIN_STEPS or variance < MIN_ROWS_VARIANCE:
            return
        per_row = (self._rows_seconds - self._rows * self._seconds) / variance
        if per_row <= 1e-6 * self._seconds:  # rows cost nothing measurable
            self._fixed_rows = None
            return
        self._fixed_rows = max(self._seconds - per_row * self._rows, 0.0) / per_row

    def fixed_rows(self) -> float | None:
        """F: a step's cost beyond its rows, in rows; None until measured, or where rows are free."""
        return self._fixed_rows
