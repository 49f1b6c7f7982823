"""Where a decode step's time goes on a GPU: step wall time, GPU kernel time, the GPU's busy
fraction, kernels per step and the kernels that cost most, per batch size, with synchronous and
asynchronous scheduling, and with the compiler's fusion passes off (mode `unfused`: asynchronous
scheduling, `compile_passes=[]`, batches up to 8) for the kernels per step before and after them.

The engine runs in this process (`LLMEngine.step()`, as `LLM.generate` drives it) at -O2
(compiled pieces + CUDA graphs) in bf16 on a model of SmolLM2-135M's shape with random weights.
Each request has a 128-token prompt; after the prefill step and a warm-up, it reports:

- `step_ms`: the median wall time between two `step()` returns over 128 steps, with nothing
  added that waits for the GPU (a synchronous step waits for its sampled tokens itself; an
  asynchronous one overlaps the next step's host work with this one's GPU work), and
  `tokens_per_s` = batch / step_ms;
- from `torch.profiler` (CUDA activities only, so the host side runs at full speed) over 48
  further steps: `kernel_ms_per_step` (the sum of kernel durations / steps),
  `busy_ms_per_step` (the union of the intervals in which a kernel, copy or memset ran / steps),
  `busy_fraction` (that union / the profiled window's wall time), `kernels_per_step`,
  `copies_per_step`, the CUDA runtime calls per step, and the top kernels by total time (name,
  calls per step, microseconds per call). `profiled_step_ms` (the window's wall time / steps)
  next to `step_ms` shows what the profiler itself added.

`--trace FILE.json.gz` also writes a Chrome/Perfetto trace (CPU and CUDA) of a few batch-1 steps
of the first mode, and FILE_<mode>.json.gz of the second (asynchronous against synchronous
scheduling: on an H200 on 2026-12-04 asynchronous steps ran 60 more kernels, 58 of them cuBLAS
`memcpy32_post` copies beside "badd" GEMMs, and were slower; the sync trace says what differs).
Without a GPU it runs a CPU smoke version (tiny model, -O1, CPU activities: top-level aten ops
stand in for kernels) that checks the script, not the engine's speed.

    python benchmarks/gpu_profile.py [--json profile.json] [--trace trace.json.gz] [--batches 1,8,32,64]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from gpu_workload import Budget, ResultsFile, model_config, on_gpu, prompt_ids, sync
from torch.profiler import ProfilerActivity, profile

from compiled_llm import LLM, SamplingParams
from compiled_llm.models.dummy import write_dummy_model

TOP_KERNELS = 15


@dataclass
class Activity:
    """One thing the device did (a kernel, a copy or a memset), in microseconds."""

    name: str
    start_us: float
    end_us: float
    is_kernel: bool


def device_activities(prof: profile, gpu: bool) -> list[Activity]:
    """The GPU's kernels, copies and memsets; on a CPU the top-level aten ops stand in for them."""
    found = []
    for event in prof.events():
        if gpu:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            is_kernel = not event.name.startswith(("Memcpy", "Memset"))
        else:
            parent = event.cpu_parent
            if not event.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
                continue
            is_kernel = True
        found.append(Activity(event.name, event.time_range.start, event.time_range.end, is_kernel))
    return found


def runtime_calls(prof: profile) -> dict[str, int]:
    """How often the host called each CUDA runtime/driver function (cudaGraphLaunch, cudaLaunchKernel,
    cudaMemcpyAsync, ...): the launches the host pays for."""
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith(("cuda", "cu")):
            counts[event.name] += 1
    return counts


def union_us(activities: list[Activity]) -> float:
    """Time during which at least one activity ran (overlapping kernels count once)."""
    total, end = 0.0, float("-inf")
    for a in sorted(activities, key=lambda a: a.start_us):
        if a.end_us <= end:
            continue
        total += a.end_us - max(a.start_us, end)
        end = a.end_us
    return total


def summarize(activities: list[Activity], calls: dict[str, int], steps: int, window_s: float) -> dict[str, Any]:
    kernels = [a for a in activities if a.is_kernel]
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k.name].append(k.end_us - k.start_us)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    busy_us = union_us(activities)
    return {
        "profiled_steps": steps,
        "profiled_step_ms": window_s * 1e3 / steps,
        "kernel_ms_per_step": sum(k.end_us - k.start_us for k in kernels) / steps / 1e3,
        "busy_ms_per_step": busy_us / steps / 1e3,
        "busy_fraction": busy_us / 1e6 / window_s,
        "kernels_per_step": len(kernels) / steps,
        "copies_per_step": (len(activities) - len(kernels)) / steps,
        "runtime_calls_per_step": {name: n / steps for name, n in sorted(calls.items(), key=lambda i: -i[1])},
        "top_kernels": [
            {"name": name, "calls_per_step": len(durations) / steps, "us_per_call": statistics.fmean(durations),
             "ms_per_step": sum(durations) / steps / 1e3}
            for name, durations in top
        ],
    }


@dataclass
class Lengths:
    prompt: int
    warmup: int
    timed: int
    profiled: int
    traced: int


def measure_batch(llm: LLM, batch: int, lengths: Lengths, vocab_size: int, trace: str | None) -> dict[str, Any]:
    """Decode `batch` requests together and measure their steps (the prefill step left out)."""
    engine = llm.llm_engine
    gpu = on_gpu()
    # Enough tokens for every measured step, and a few more: the last steps (requests ending) are not measured.
    new_tokens = lengths.warmup + lengths.timed + lengths.profiled + lengths.traced + 4
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    tag = f"b{batch}-{time.monotonic_ns()}"
    for i, ids in enumerate(prompt_ids(batch, lengths.prompt, vocab_size)):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    engine.step()  # the prefill (all prompts fit one step)
    for _ in range(lengths.warmup):
        engine.step()

    intervals = []
    last = time.perf_counter()
    for _ in range(lengths.timed):
        engine.step()
        now = time.perf_counter()
        intervals.append(now - last)
        last = now
    step_s = statistics.median(intervals)

    sync()
    with profile(activities=[ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]) as prof:
        sync()
        start = time.perf_counter()
        for _ in range(lengths.profiled):
            engine.step()
        sync()
        window_s = time.perf_counter() - start
    row = {"batch": batch, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
           "step_ms_p90": sorted(intervals)[int(0.9 * (len(intervals) - 1))] * 1e3}
    activities = device_activities(prof, gpu)
    if not activities:
        print("warning: the profiler recorded no device activity (is CUPTI available?)", flush=True)
    row.update(summarize(activities, runtime_calls(prof), lengths.profiled, window_s))
    del prof
    if trace:
        write_trace(engine, trace, gpu, lengths.traced)
    while engine.has_unfinished_requests():
        engine.step()
    return row


def write_trace(engine: Any, path: str, gpu: bool, steps: int) -> None:
    """A Chrome/Perfetto trace of a few steps, host and device, gzipped."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    plain = path[: -len(".gz")] if path.endswith(".gz") else path
    prof.export_chrome_trace(plain)
    if plain != path:
        with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(plain)


def build_engine(folder: str, level: int, cache: str, mode: str, max_batch: int) -> LLM:
    gpu = on_gpu()
    return LLM(folder, load_format="dummy", dtype="bfloat16" if gpu else "float32", optimization_level=level,
               compile_cache=cache, max_model_len=1024, max_num_seqs=max_batch, enable_prefix_caching=False,
               async_scheduling=mode != "sync", compile_passes=[] if mode == "unfused" else None,
               kv_cache_memory_bytes=(4 << 30) if gpu else (64 << 20))


def print_table(results: ResultsFile) -> None:
    rows = results.results
    print(f"\n-O{results.data['level']} decode steps ({results.data['device']})")
    print(f"{'mode/batch':>11} {'step ms':>8} {'tok/s':>9} {'kernel ms':>9} {'busy ms':>8} {'busy':>6}"
          f" {'kernels':>8} {'copies':>7} {'profiled step ms':>16}")
    for name, r in rows.items():
        print(f"{name:>11} {r['step_ms']:8.3f} {r['tokens_per_s']:9.1f} {r['kernel_ms_per_step']:9.3f}"
              f" {r['busy_ms_per_step']:8.3f} {r['busy_fraction']:6.1%} {r['kernels_per_step']:8.1f}"
              f" {r['copies_per_step']:7.1f} {r['profiled_step_ms']:16.3f}")
    for name in [n for n in rows if n.endswith("/b1")][:1] or list(rows)[:1]:
        print(f"\ntop kernels, {name} (calls/step, us/call, ms/step, name):")
        for k in rows[name]["top_kernels"]:
            print(f"  {k['calls_per_step']:6.1f} {k['us_per_call']:9.2f} {k['ms_per_step']:8.4f}  {k['name'][:100]}")
        calls = ", ".join(f"{n} {c:.1f}" for n, c in list(rows[name]["runtime_calls_per_step"].items())[:6])
        print(f"  runtime calls per step: {calls or 'none recorded'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the results here (after every figure)")
    parser.add_argument("--trace", default=None, help="write a trace of batch-1 steps here (.json or .json.gz)")
    parser.add_argument("--batches", default=None, help="default 1,8,32,64 (CPU smoke: 1,2)")
    parser.add_argument("--modes", default="async,sync,unfused",
                        help="in this order: async, sync (scheduling), unfused (async, no fusion passes)")
    parser.add_argument("--level", type=int, default=None, help="optimization level (default 2; CPU smoke: 1)")
    parser.add_argument("--compile-cache", default=None, help="compile cache folder (default: a temporary one)")
    parser.add_argument("--budget-s", type=float, default=150, help="skip parts that would end later than this")
    args = parser.parse_args()
    gpu = on_gpu()
    budget = Budget(args.budget_s)
    if gpu:
        lengths, batches, level = Lengths(prompt=128, warmup=16, timed=128, profiled=48, traced=6), [1, 8, 32, 64], 2
    else:
        print("no CUDA device: running a small CPU smoke version (not a measurement)")
        lengths, batches, level = Lengths(prompt=16, warmup=2, timed=8, profiled=4, traced=2), [1, 2], 1
    batches = [int(b) for b in args.batches.split(",")] if args.batches else batches
    level = args.level if args.level is not None else level
    modes = [m.strip() for m in args.modes.split(",")]
    if bad := [m for m in modes if m not in ("async", "sync", "unfused")]:
        parser.error(f"--modes takes async, sync and unfused, got {bad}")
    config = model_config()
    results = ResultsFile(args.json, level=level, lengths=vars(lengths))
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dummy_model(f"{tmp}/model", config)
        cache = args.compile_cache or f"{tmp}/cache"
        engine_s = item_s = 0.0
        for mode in modes:
            if engine_s and not budget.allows(engine_s + item_s * len(batches)):
                results.skip(f"{mode}: the engine")
                continue
            started = time.perf_counter()
            try:
                llm = build_engine(folder, level, cache, mode, max(batches))
            except Exception:
                results.fail(f"{mode}: the engine")
                continue
            engine_s = max(engine_s, time.perf_counter() - started)
            print(f"-O{level} {mode}: engine ready in {time.perf_counter() - started:.1f} s", flush=True)
            for batch in [b for b in batches if mode != "unfused" or b <= 8]:
                name = f"{mode}/b{batch}"
                if item_s and not budget.allows(item_s * 1.5):
                    results.skip(name)
                    continue
                t = time.perf_counter()
                try:
                    trace = None  # the first batch size's steps, once per scheduling mode (not unfused)
                    if args.trace and batch == batches[0] and mode != "unfused":
                        trace = args.trace if mode == modes[0] else args.trace.replace(".json", f"_{mode}.json")
                    row = measure_batch(llm, batch, lengths, config["vocab_size"], trace)
                except Exception:
                    results.fail(name)
                    continue
                item_s = max(item_s, time.perf_counter() - t)
                results.record(name, row)
                print(f"{name}: step {row['step_ms']:.3f} ms, {row['tokens_per_s']:.1f} tok/s, kernels "
                      f"{row['kernel_ms_per_step']:.3f} ms, busy {row['busy_fraction']:.1%}, "
                      f"{row['kernels_per_step']:.0f} kernels/step ({time.perf_counter() - t:.1f} s)", flush=True)
            del llm
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
    print_table(results)
    sys.exit(1 if results.errors else 0)


if __name__ == "__main__":
    main()
