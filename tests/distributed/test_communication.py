"""The all-reduce op is counted and timed only inside `timed_all_reduces`, as a benchmark asks; its
result is the same either way (a copy on a single rank)."""

from __future__ import annotations

import torch

from compiled_llm.distributed import communication


def test_all_reduces_are_timed_only_inside_the_context():
    x = torch.arange(6.0).reshape(2, 3)
    with communication.timed_all_reduces() as timing:
        inside = [torch.ops.compiled_llm.tp_all_reduce(x) for _ in range(3)]
    outside = torch.ops.compiled_llm.tp_all_reduce(x)
    assert timing.calls == 3 and timing.seconds > 0
    assert all(torch.equal(out, x) and out is not x for out in [*inside, outside])
    with communication.timed_all_reduces() as fresh:
        pass
    assert fresh.calls == 0 and fresh.seconds == 0
