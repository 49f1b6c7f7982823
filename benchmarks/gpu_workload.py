"""What the GPU benchmarks share: the model they run (SmolLM2-135M's shape with random weights, or
a tiny stand-in for the CPU smoke run), the prompts, a time budget, and a results file that is
rewritten after every figure, so a step stopped by its time box keeps what it measured.

    python benchmarks/gpu_workload.py DIR   # writes that model's folder (for `compiled-llm precompile`)

The GPU check gets one try on a lent machine: every script must leave its figures behind even
when a later part of it fails or runs out of time.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import torch

from compiled_llm.models.dummy import SMOLLM2_135M

# Without a GPU each benchmark runs this shrunken model, to check the script, not to measure.
CPU_SMOKE_SHAPE: dict[str, Any] = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512,
)


def on_gpu() -> bool:
    return torch.cuda.is_available()


def device_name() -> str:
    return torch.cuda.get_device_name() if on_gpu() else "cpu-smoke"


def model_config() -> dict[str, Any]:
    """SmolLM2-135M's config on a GPU; the smoke shape on a CPU (the same for every script, so they
    share compile-cache entries)."""
    config = dict(SMOLLM2_135M)
    if not on_gpu():
        config.update(CPU_SMOKE_SHAPE)
    return config


def prompt_ids(batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """`batch` distinct prompts of `prompt_len` token ids (no shared prefix past the first token)."""
    span = vocab_size - 3
    return [[(31 * i + 7 * j + i * j) % span + 3 for j in range(prompt_len)] for i in range(batch)]


def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


class Budget:
    """Seconds left for a script's optional parts: a part runs only if the time it is expected to
    take (the longest such part so far, or a guess) still fits, so the step's time box never cuts
    the figures that matter in the middle."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, expected_seconds: float) -> bool:
        return self.left() > expected_seconds


class ResultsFile:
    """A JSON object written out whole (temp file, then rename) after every change: figures go
    into `results`, parts left out for lack of time into `skipped`, failures into `errors`."""

    def __init__(self, path: str | None, **header: Any) -> None:
        self.path = path
        self.data: dict[str, Any] = {"device": device_name(), "torch": torch.__version__, **header,
                                     "results": {}, "skipped": [], "errors": {}}
        self.write()

    @property
    def results(self) -> dict[str, Any]:
        return self.data["results"]

    @property
    def errors(self) -> dict[str, str]:
        return self.data["errors"]

    def record(self, key: str, value: Any) -> None:
        self.data["results"][key] = value
        self.write()

    def skip(self, what: str) -> None:
        print(f"{what}: skipped, no time left in the budget", flush=True)
        self.data["skipped"].append(what)
        self.write()

    def fail(self, what: str) -> None:
        """Record the exception being handled (and print it): one part failing must not hide the
        others' figures."""
        traceback.print_exc()
        self.data["errors"][what] = traceback.format_exc(limit=4)
        self.write()

    def write(self) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2)
        os.replace(tmp, self.path)


if __name__ == "__main__":
    from compiled_llm.models.dummy import write_dummy_model

    print(write_dummy_model(sys.argv[1], model_config()))
