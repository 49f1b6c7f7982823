"""The compiler's fusion passes on a CPU: kernel calls per decode step and step time, with every
pass against none, on the bundled SmolLM2-135M at -O1 (float32), both engines in this process.

Each engine compiles into its own folder of a temporary compile cache with Inductor's kernel
profiling on (every generated C++ kernel records a profiler event; the same for both engines).
Per batch size it reports, from torch.profiler over `--profiled` decode steps of each engine:
- `inductor_kernels`: Inductor's generated kernels (norms, rotary, SiLU-and-mul, ...);
- `cpp_ops`: this project's C++ ops called from a piece or an attention op (packed GEMMs,
  attention steps), not counting those they call themselves;
- `kernel_calls` = the two: what the passes reduce;
- `top_level_aten`: other ATen ops at the top level (sampling, input preparation): unchanged;
and, from `--rounds` alternated timed rounds of `--steps` steps (fused, unfused, fused, ...),
the median step time of each.

    python benchmarks/fusion_passes.py [--batches 1,8] [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from typing import Any

from machine import default_threads, format_machine, machine_report
from torch.profiler import ProfilerActivity, profile

from compiled_llm import LLM, SamplingParams
from compiled_llm.bundled_model import bundled_model_path

PROFILED_INDUCTOR = {"size_asserts": False, "cpp.threads": 1, "cpp.enable_kernel_profile": True}


def classify(prof: profile, steps: int) -> dict[str, float]:
    counts: Counter[str] = Counter()
    for event in prof.events():
        name, parent = event.name, event.cpu_parent
        if "cpp_fused" in name:
            counts["inductor_kernels"] += 1
        elif name.startswith("compiled_llm_cpu::"):
            if parent is None or not parent.name.startswith("compiled_llm_cpu::"):
                counts["cpp_ops"] += 1
        elif name.startswith("aten::") and parent is None:
            counts["top_level_aten"] += 1
    row = {k: counts[k] / steps for k in ("inductor_kernels", "cpp_ops", "top_level_aten")}
    row["kernel_calls"] = row["inductor_kernels"] + row["cpp_ops"]
    return row


def build(cache: str, passes: list[str] | None, max_batch: int) -> LLM:
    return LLM(str(bundled_model_path()), optimization_level=1, compile_cache=cache, compile_passes=passes,
               inductor_options=PROFILED_INDUCTOR, max_model_len=1024, max_num_seqs=max_batch,
               kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)


def timed_steps(llm: LLM, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        llm.llm_engine.step()
    return (time.perf_counter() - start) / steps


def measure(engines: dict[str, LLM], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    total = 1 + 3 + args.rounds * args.steps + args.profiled + 2
    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    for name, llm in engines.items():
        for i in range(batch):
            ids = [(7 * i + 13 * j) % 40000 + 100 for j in range(64)]
            llm.llm_engine.add_request(f"{name}-b{batch}-{i}", {"prompt_token_ids": ids}, params)
        for _ in range(4):  # the prefill and a warm-up
            llm.llm_engine.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            times[name].append(timed_steps(llm, args.steps))
    rows = {}
    for name, llm in engines.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed_steps(llm, args.profiled)
        rows[name] = classify(prof, args.profiled) | {"step_ms": statistics.median(times[name]) * 1e3,
                                                      "best_round_step_ms": min(times[name]) * 1e3}
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=16, help="decode steps in a timed round")
    parser.add_argument("--profiled", type=int, default=8, help="decode steps profiled")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    machine = machine_report(default_threads())
    print(format_machine(machine), flush=True)
    results: dict[str, Any] = {"machine": machine, "args": vars(args), "results": {}}
    with tempfile.TemporaryDirectory() as cache:
        engines = {"fused": build(cache, None, max(batches)), "unfused": build(cache, [], max(batches))}
        print(f"{'batch':>5} {'engine':>8} {'step ms':>8} {'kernel calls':>12} {'inductor':>8} {'C++ ops':>8}"
              f" {'other aten':>10}")
        for batch in batches:
            rows = measure(engines, batch, args)
            results["results"][f"b{batch}"] = rows
            for name, r in rows.items():
                print(f"{batch:>5} {name:>8} {r['step_ms']:8.2f} {r['kernel_calls']:12.1f} {r['inductor_kernels']:8.1f}"
                      f" {r['cpp_ops']:8.1f} {r['top_level_aten']:10.1f}", flush=True)
            f, u = rows["fused"], rows["unfused"]
            print(f"      fused/unfused: step time {f['step_ms'] / u['step_ms']:.3f}x (best rounds "
                  f"{f['best_round_step_ms']:.2f} vs {u['best_round_step_ms']:.2f} ms), kernel calls "
                  f"{f['kernel_calls']:.0f} vs {u['kernel_calls']:.0f} ({f['kernel_calls'] - u['kernel_calls']:+.0f})",
                  flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
