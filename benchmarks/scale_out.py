"""Scale-out on the machine at hand, with the same total threads on every side:

- data parallelism: `compiled-llm serve` with --data-parallel-size 2 (two engines, half the
  threads each) against one engine (all the threads), on the serving workload (the throughput
  workload's prompts and lengths, greedy, ignore_eos, one response each) at concurrency 8 and 32;
- tensor parallelism: the offline engine at -tp 2 (two ranks, half the threads each) against -tp 1,
  batch-1 and batch-32 decode, with what the all-reduces cost per step (their wall time in the
  driver, timed around the custom op that the compiled pieces call, only while decoding here).

Medians of --runs runs. On a 2-core CPU neither is expected to be faster: the point is what each
costs, and what limits it.

    python benchmarks/scale_out.py [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from workload import throughput_workload


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- data parallelism: serving ----------------------------------------------------------------
def start_server(model: str | None, dp: int, threads: int, port: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", *([model] if model else []),
           "--port", str(port), "--data-parallel-size", str(dp), "--num-threads", str(max(1, threads // dp)),
           "--no-enable-prefix-caching", "--max-model-len", "2048"]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"scale-out-dp{dp}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the dp={dp} server exited; log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the dp={dp} server did not start; log: {log.name}")


async def serve_level(url: str, prompts: list[tuple[list[int], int]], concurrency: int) -> float:
    """Output tokens/s of the prompts sent `concurrency` at a time."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, ids: list[int], out_len: int) -> int:
        async with semaphore:
            body = {"prompt": ids, "max_tokens": out_len, "temperature": 0, "ignore_eos": True}
            r = await http.post(url + "/v1/completions", json=body)
            return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=concurrency)) as http:
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(http, ids, n) for ids, n in prompts))
        return sum(tokens) / (time.perf_counter() - started)


def bench_dp(model: str | None, threads: int, levels: list[int], runs: int, prompts) -> dict:
    results: dict = {}
    for dp in (1, 2):
        proc, url = start_server(model, dp, threads, free_port())
        try:
            for c in levels:
                rates = [asyncio.run(serve_level(url, prompts, c)) for _ in range(runs)]
                results[f"dp{dp}_c{c}"] = statistics.median(rates)
                print(f"  dp={dp} concurrency {c}: {results[f'dp{dp}_c{c}']:.1f} output tok/s", flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    return results


# ---- tensor parallelism: offline decode --------------------------------------------------------
def bench_tp(model: str | None, threads: int, batches: list[int], runs: int, new_tokens: int) -> dict:
    from compiled_llm import LLM, SamplingParams
    from compiled_llm.distributed import communication

    results: dict = {}
    for tp in (1, 2):
        llm = LLM(model, tensor_parallel_size=tp, num_threads=max(1, threads // tp), max_model_len=1024,
                  kv_cache_memory_bytes=512 << 20)
        engine = llm.llm_engine
        try:
            for batch in batches:
                rates, reduce_ms = [], []
                for run in range(runs):
                    for i in range(batch):
                        ids = [(31 * i + j + run) % 40000 + 3 for j in range(128)]
                        engine.add_request(f"tp{tp}-b{batch}-{run}-{i}", {"prompt_token_ids": ids},
                                           SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
                    engine.step()  # the prefill
                    with communication.timed_all_reduces() as all_reduces:
                        steps, started = 0, time.perf_counter()
                        while engine.has_unfinished_requests():
                            engine.step()
                            steps += 1
                        elapsed = time.perf_counter() - started
                    rates.append(batch * (new_tokens - 1) / elapsed)
                    reduce_ms.append(all_reduces.seconds / max(steps, 1) * 1e3)
                results[f"tp{tp}_b{batch}"] = statistics.median(rates)
                results[f"tp{tp}_b{batch}_allreduce_ms_per_step"] = statistics.median(reduce_ms)
                print(f"  tp={tp} batch {batch}: {results[f'tp{tp}_b{batch}']:.1f} decode tok/s, all-reduce "
                      f"{results[f'tp{tp}_b{batch}_allreduce_ms_per_step']:.2f} ms a step (driver)", flush=True)
        finally:
            engine.engine_core.shutdown()
            del llm
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model folder (default: the bundled SmolLM2-135M-Instruct).")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="A few short requests, one run: checks it all runs.")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from compiled_llm.bundled_model import bundled_model_path

    model = args.model or str(bundled_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = throughput_workload(tokenizer, num_requests=8 if args.quick else 32)
    prompts = [(r.prompt_token_ids, 8 if args.quick else r.output_len) for r in requests]
    runs = 1 if args.quick else args.runs
    print(f"threads {args.threads}; data parallelism (serve, {len(prompts)} requests):", flush=True)
    results = bench_dp(model, args.threads, [8] if args.quick else [8, 32], runs, prompts)
    print("tensor parallelism (offline decode, 128-token prompts):", flush=True)
    results.update(bench_tp(model, args.threads, [1] if args.quick else [1, 32], runs, 8 if args.quick else 64))
    print(json.dumps(results, indent=1))
    for key in [k for k in results if k.startswith("dp2_")]:
        print(f"dp2 / dp1 at {key[4:]}: {results[key] / results['dp1' + key[3:]]:.2f}x")
    for key in [k for k in results if k.startswith("tp2_b") and not k.endswith("step")]:
        print(f"tp2 / tp1 at {key[4:]}: {results[key] / results['tp1' + key[3:]]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
