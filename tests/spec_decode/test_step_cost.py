"""The step cost fit: a decode step's time as a fixed part plus a cost per row, whose ratio (the
fixed part in rows) sets how many of its drafts a request needs accepted at a batch size."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.spec_decode.step_cost import MIN_STEPS, StepCost


@settings(max_examples=60, deadline=None)
@given(fixed=st.floats(1e-4, 0.05), per_row=st.floats(1e-5, 0.01),
       rows=st.lists(st.integers(1, 200), min_size=MIN_STEPS, max_size=80).filter(lambda r: len(set(r)) > 1))
def test_the_fit_recovers_the_fixed_part_in_rows(fixed, per_row, rows):
    cost = StepCost()
    for r in rows:
        cost.observe(r, fixed + per_row * r)
    got = cost.fixed_rows()
    spread = max(rows[-20:]) - min(rows[-20:])
    if got is not None or spread > 1:  # the latest window's rows vary: the fit stands on them
        assert got is not None and abs(got - fixed / per_row) <= 1e-6 * max(1.0, fixed / per_row)


def test_nothing_is_said_before_enough_steps_or_where_rows_do_not_vary():
    cost = StepCost()
    for r in [1, 5] * (MIN_STEPS // 2 - 1):
        cost.observe(r, 6.5e-3 + 2e-3 * r)
    assert cost.fixed_rows() is None  # too few steps
    cost.observe(1, 8.5e-3)
    cost.observe(5, 16.5e-3)
    assert abs(cost.fixed_rows() - 3.25) < 1e-6
    for _ in range(200):  # every request paused: one row a step, whatever each takes
        cost.observe(1, 8.5e-3)
    assert abs(cost.fixed_rows() - 3.25) < 1e-6  # the last fit stands


def test_rows_that_cost_nothing_measurable_leave_it_unset():
    cost = StepCost()
    for i in range(40):
        cost.observe(1 + i % 5, 5e-3 - 1e-6 * (i % 5))
    assert cost.fixed_rows() is None
