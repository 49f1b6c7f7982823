"""The serving processes freeze their start-up heap: a full collection then no longer walks the
model, the tokenizer and every module (half a second to two seconds on 2 cores, at random moments
under load). Start-up itself runs with the collector paused (`serve` until the freeze, the offline
`LLM` while it imports and builds), and the collector is on again after it."""

from __future__ import annotations

import gc

import pytest
import torch

from compiled_llm.utils import freeze_gc_heap, gc_paused


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


@pytest.mark.parametrize("enabled", [True, False])
def test_a_pause_leaves_the_collector_as_it_found_it(enabled):
    (gc.enable if enabled else gc.disable)()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError("a failed start-up")
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


def test_the_freeze_ends_serves_paused_start_up():
    gc.disable()  # as `compiled-llm serve` starts (cli.main)
    try:
        freeze_gc_heap()
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_the_offline_llm_collects_on_after_it_is_built(tiny_llama):
    import compiled_llm

    threads = torch.get_num_threads()
    try:
        llm = compiled_llm.LLM(tiny_llama, optimization_level=0, max_model_len=64, kv_cache_memory_bytes=1 << 20,
                               num_threads=1)
        assert gc.isenabled()
        collections = gc.get_stats()[0]["collections"]
        [Held() for _ in range(10 * gc.get_threshold()[0])]  # enough new objects for a young collection
        assert gc.get_stats()[0]["collections"] > collections
        del llm
    finally:
        torch.set_num_threads(threads)
