"""Triton kernels' CPU cases run by Triton's interpreter in one subprocess (TRITON_INTERPRET=1 with
the test file as its script), so the interpreter never leaks into other tests: the script prints
each case's traceback (None if it passed) as JSON, the test reads it back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

REPO = str(Path(__file__).resolve().parents[2])  # the scripts import tests.*


def run_cases(cases: dict[str, Callable[[], None]]) -> dict[str, str | None]:
    """In the script: every case, its traceback or None."""
    results: dict[str, str | None] = {}
    for name, case in cases.items():
        try:
            case()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results


def print_results(cases: dict[str, Callable[[], None]]) -> None:
    print(json.dumps(run_cases(cases)))


def interpret(script: str) -> dict[str, str | None]:
    """In the test: run `script` under the interpreter and read its cases' results."""
    path = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
