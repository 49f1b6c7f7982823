"""What the CPU benchmarks share besides the workload: the machine report, the thread count and
dtypes to run, and the arithmetic on step timings (host time per step, effective GB/s).

Standard library only at import: peer_vllm.py imports it inside vLLM's own venv too.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import struct
import time
from pathlib import Path

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_info() -> dict:
    """CPU model and the flags that pick a path (no /proc/cpuinfo: the platform's processor name)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in FLAGS}}


def native_bf16(info: dict | None = None) -> bool:
    """True where bf16 matmuls run natively (avx512_bf16 or AMX); elsewhere bf16 is ~100x slower."""
    flags = (info or cpu_info())["flags"]
    return bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))


def default_threads() -> int:
    return int(os.environ.get("COMPILED_LLM_NUM_THREADS", 0)) or (os.cpu_count() or 1)


def dtypes_to_run(choice: str) -> list[str]:
    """`auto`: float32, and bfloat16 too where the CPU has native bf16."""
    if choice == "auto":
        return ["float32"] + (["bfloat16"] if native_bf16() else [])
    return [d for d in choice.split(",") if d]


def read_bandwidth_gb_s(threads: int, gigabytes: float = 1.0, passes: int = 5) -> float:
    """Memory read bandwidth: torch sum over a `gigabytes` float32 array with `threads` threads
    (best pass after one warm-up pass)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gigabytes * 2**30) // 4, dtype=torch.float32)
        x.sum()
        best = float("inf")
        for _ in range(passes):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def machine_report(threads: int) -> dict:
    info = cpu_info()
    info["threads"] = threads
    info["native_bf16"] = native_bf16(info)
    info["read_gb_s"] = read_bandwidth_gb_s(threads)
    return info


def format_machine(m: dict) -> str:
    flags = " ".join(f"{f}{'+' if on else '-'}" for f, on in m["flags"].items())
    return (f"machine: {m['cpu']}, {m['cores']} cores; {flags}; {m['threads']} threads; "
            f"memory read {m['read_gb_s']:.1f} GB/s (torch sum over 1 GB, {m['threads']} threads)")


# ---- bytes a batch-1 decode step reads ----------------------------------------------------------------
_ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


def _safetensors_numels(folder: Path) -> dict[str, int]:
    numels: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                numels[name] = count
    return numels


def decode_step_bytes(model_folder: str, dtype: str, context_tokens: float) -> float:
    """Bytes one batch-1 decode step must read: every weight once (the embedding table only where
    it doubles as the output projection, i.e. tied), plus the KV cache of `context_tokens` tokens."""
    folder = Path(model_folder)
    cfg = json.loads((folder / "config.json").read_text())
    numels = _safetensors_numels(folder)
    params = sum(numels.values())
    if any(k.endswith("lm_head.weight") for k in numels):
        params -= sum(v for k, v in numels.items() if k.endswith("embed_tokens.weight"))  # a lookup reads one row
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim
    return (params + kv_per_token * context_tokens) * _ELEM[dtype]


# ---- host time per step ---------------------------------------------------------------------------
def step_breakdown(events: list, tokens: int | None = None) -> dict | None:
    """Split the decode steps of a run into model time and host time.

    `events`: [kind, start, seconds, tokens] in call order, kind "f" for a model forward (one a
    step, over `tokens` tokens) and "l" for the logits projection that follows it. A step runs from
    one forward's start to the next's; its model time is its forward plus its logits; the rest
    (scheduling, input preparation, sampling, output processing, the engine's own IPC) is host
    time. Only steps of `tokens` tokens whose next step is one too count (a batch-1 decode: every
    step after the prefill but the last; a batch of 32: the steps where all 32 decode).
    """
    steps: list[list[float]] = []  # [start, model seconds, tokens]
    for kind, start, seconds, *rest in events:
        if kind == "f":
            steps.append([start, seconds, rest[0] if rest else None])
        elif steps:
            steps[-1][1] += seconds
    if tokens is None:  # a single-request run: its first step is the prefill
        steps = steps[1:]
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if tokens is None or a[2] == b[2] == tokens]
    if len(pairs) < 3:
        return None
    periods = [b[0] - a[0] for a, b in pairs]
    models = [a[1] for a, _ in pairs]
    return {
        "step_ms": 1000 * statistics.median(periods),
        "model_ms": 1000 * statistics.median(models),
        "host_ms": 1000 * statistics.median(p - m for p, m in zip(periods, models)),
        "steps": len(periods),
    }


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"
