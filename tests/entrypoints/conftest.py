"""One server for the API feature tests (structured outputs, tools, scoring, the remaining
fields, lm-eval): the bundled model, compiled from the warm compile cache, with auto tool choice
parsed in the Hermes format. Started once per session and shared, to keep the suite short."""

from __future__ import annotations

import pytest
from remote_server import RemoteServer

API_SERVER_FLAGS = [
    "-O1", "--require-cache-hit", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20),
    "--max-num-seqs", "32", "--served-model-name", "smol", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
]


@pytest.fixture(scope="session")
def api_server(real_model_path, warm_compile_cache):
    pytest.importorskip("openai")  # absent on the GPU image, where only cuda tests run
    server = RemoteServer([real_model_path, *API_SERVER_FLAGS])
    yield server
    server.stop()
