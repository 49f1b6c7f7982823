"""Stands in for vLLM's `tests/conftest.py`: the modules this harness runs need none of its
fixtures (their data fixtures live in `tests/entrypoints/conftest.py`, which is copied)."""

import pytest


class LocalAssetServer:
    """Named by test_metrics.py's signature; only its multimodal case (not run) uses one."""


@pytest.fixture(scope="session")
def local_asset_server() -> LocalAssetServer:
    return LocalAssetServer()
