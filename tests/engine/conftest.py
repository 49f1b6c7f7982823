"""Fixtures for the frontend tests that drive `AsyncLLM` from synchronous test functions."""

from __future__ import annotations

import asyncio
import threading

import pytest


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module, on its own thread: the engine's output handler lives on it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
