"""One logger configuration for the whole package, so every process logs the same way."""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "compiled_llm"
_configured = False


def _configure() -> None:
    global _configured
    if _configured:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
    )
    root = logging.getLogger(_ROOT)
    root.addHandler(handler)
    root.setLevel(os.environ.get("COMPILED_LLM_LOG_LEVEL", "INFO").upper())
    root.propagate = False
    _configured = True


def init_logger(name: str) -> logging.Logger:
    _configure()
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
