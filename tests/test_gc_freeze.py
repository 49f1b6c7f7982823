"""The serving processes freeze their start-up heap: a full collection then no longer walks the
model, the tokenizer and every module (half a second to two seconds on 2 cores, at random moments
under load)."""

from __future__ import annotations

import gc

from compiled_llm.utils import freeze_gc_heap


class Held:
    """An object the collector tracks (a plain dict of numbers is not tracked at all)."""


def test_what_exists_at_freezing_leaves_the_collections():
    start_up_state = [Held() for _ in range(1000)]
    assert all(gc.is_tracked(obj) for obj in start_up_state)
    try:
        freeze_gc_heap()
        assert gc.get_freeze_count() >= len(start_up_state)
        made_later = Held()
        tracked = {id(obj) for obj in gc.get_objects()}
        assert not any(id(obj) in tracked for obj in start_up_state)
        assert id(made_later) in tracked
    finally:
        gc.unfreeze()
