"""`compiled-llm serve` as a user starts it on a GPU (its defaults there: -O2, bf16, the KV cache
sized by a profiling run, asynchronous scheduling), on a model of SmolLM2-135M's shape with
random weights, loaded by streaming /v1/completions clients at concurrency 1, 8 and 32, against
the offline rate of the same requests at the same concurrency.

Per level it reports requests/s, output tokens/s and median/p99 TTFT and ITL at the client; then
the same requests go through the in-process engine (`LLMEngine`, as `LLM.generate` drives it, in
this process after the server has stopped, same settings), at most `c` at a time as the `c`
clients keep them, and `serve_over_offline` is the server's output tokens/s over that offline
rate: what the HTTP server, the frontend process and the IPC cost. This runs with asynchronous
scheduling (the GPU default), then at the highest concurrency with `--api-server-count N` (several
API server processes, `--api-servers`; compared with the same offline rate), and again with
`--no-async-scheduling`, while `--budget-s` allows.

It also checks what a user relies on: every request gets all its tokens, /metrics answers, the
server logs its CUDA graphs and KV sizing, and SIGTERM ends it cleanly. Prompts are words of the
model's generated vocabulary, 64-512 tokens; outputs 32-256 tokens, EOS ignored. Without a GPU it
runs a small CPU smoke version (to check the script, not to measure).

    python benchmarks/gpu_serve.py [--json serve.json] [--server-log server.log]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import signal
import sys
import tempfile
import time

import httpx
import torch
from gpu_workload import Budget, ResultsFile, model_config, on_gpu
from serve import Server, free_port, run_level

from compiled_llm import LLM, SamplingParams
from compiled_llm.models.dummy import write_dummy_model
from compiled_llm.sampling_params import RequestOutputKind

SCHEDULINGS = ("async", "sync")


def word_prompts(num: int, vocab_size: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                 seed: int = 0) -> list[tuple[str, int]]:
    """Text prompts of exact token lengths for the dummy word-level tokenizer (one word, one token)."""
    rng = random.Random(seed)
    return [
        (" ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(rng.randint(*prompt_range))),
         rng.randint(*output_range))
        for _ in range(num)
    ]


def serve_levels(folder: str, cache: str, scheduling: str, prompts: list[tuple[str, int]], levels: list[int],
                 results: ResultsFile, log_path: str | None, api_servers: int = 1) -> list[str]:
    """Start the server, load it at each level, stop it; the failures a user would notice. Results
    go under "<scheduling>/c<c>", or "<scheduling>-api<N>/c<c>" with N API server processes."""
    failures: list[str] = []
    port = free_port()
    cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", folder, "--load-format", "dummy",
           "--port", str(port), "--served-model-name", "bench", "--max-model-len", "2048",
           "--no-enable-prefix-caching", "--compile-cache", cache,
           "--async-scheduling" if scheduling == "async" else "--no-async-scheduling"]
    if api_servers > 1:
        cmd += ["--api-server-count", str(api_servers)]
        scheduling = f"{scheduling}-api{api_servers}"
    server = Server("compiled-llm", cmd, port, "bench", {"ignore_eos": True})
    try:
        print(f"serve ({scheduling} scheduling) ready {server.wait_ready():.1f} s after its start", flush=True)
        if api_servers > 1:  # /health answers once the first API server is up; let the others start too
            asyncio.run(run_level(server, prompts[:api_servers * 4], api_servers * 4))
            time.sleep(3)
        for c in levels:
            level = asyncio.run(run_level(server, prompts, c))
            short = [n for s, (_, n) in zip(level.samples, prompts) if s.output_tokens != n]
            if short:
                failures.append(f"{scheduling} c={c}: {len(short)} requests got fewer tokens than asked")
            row = level.row()
            offline = (results.results.get(f"{scheduling.split('-')[0]}/c{c}") or {}).get("offline")
            if api_servers > 1 and offline:  # the same requests' offline rate, from the round before
                ratio = row["output_tok_s"] / offline["output_tok_s"]
                results.record(f"{scheduling}/c{c}", {"serve": row, "offline": offline, "serve_over_offline": ratio})
            else:
                results.record(f"{scheduling}/c{c}", {"serve": row})
            print(f"serve   {scheduling:5s} c={c:<3d} " + "  ".join(f"{k} {v:9.2f}" for k, v in row.items()),
                  flush=True)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        if "compiled_llm:" not in metrics:
            failures.append(f"{scheduling}: /metrics has no compiled_llm: series")
    finally:
        server.stop()
        log = open(server.log.name).read()
        if log_path:
            with open(log_path, "a") as f:
                f.write(f"===== compiled-llm serve, {scheduling} scheduling: {' '.join(cmd)}\n{log}\n")
    if server.proc.returncode != 0:
        failures.append(f"{scheduling}: the server exited with {server.proc.returncode} after SIGTERM")
    wanted = ["KV cache:", "Compilation (-O"]
    if on_gpu():
        wanted += ["GPU memory:", "CUDA graphs (FULL_AND_PIECEWISE)"]
    failures += [f"{scheduling}: the server log lacks {w!r}" for w in wanted if w not in log]
    print("\n".join(line for line in log.splitlines() if any(w in line for w in wanted)), flush=True)
    return failures


def offline_level(llm: LLM, prompts: list[tuple[str, int]], concurrency: int) -> dict[str, float]:
    """The requests through the in-process engine, `concurrency` at a time (a finished one is
    replaced at once, as a client sends its next request), stepped as fast as it goes."""
    engine = llm.llm_engine

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    def run(batch: list[tuple[str, int]], tag: str) -> int:
        queue, tokens, running = list(enumerate(batch)), 0, 0
        while queue or running:
            while queue and running < concurrency:
                i, (text, n) = queue.pop(0)
                engine.add_request(f"{tag}-{i}", text, params(n))
                running += 1
            for out in engine.step():
                if out.finished:
                    running -= 1
                    tokens += len(out.outputs[0].token_ids)
        return tokens

    run(prompts[:1], f"warm-c{concurrency}")  # as the server level's warm-up request
    start = time.perf_counter()
    tokens = run(prompts, f"offline-c{concurrency}")
    wall = time.perf_counter() - start
    return {"output_tok_s": tokens / wall, "req_s": len(prompts) / wall, "output_tokens": tokens, "wall_s": wall}


def offline_levels(folder: str, cache: str, scheduling: str, prompts: list[tuple[str, int]], levels: list[int],
                   results: ResultsFile) -> None:
    started = time.perf_counter()
    llm = LLM(folder, load_format="dummy", max_model_len=2048, enable_prefix_caching=False, compile_cache=cache,
              async_scheduling=scheduling == "async",
              kv_cache_memory_bytes=(4 << 30) if on_gpu() else None)  # plenty for these requests; frees fast
    print(f"offline engine ({scheduling} scheduling) ready in {time.perf_counter() - started:.1f} s", flush=True)
    try:
        for c in levels:
            row = offline_level(llm, prompts, c)
            served = results.results.get(f"{scheduling}/c{c}", {}).get("serve")
            ratio = served["output_tok_s"] / row["output_tok_s"] if served else None
            results.record(f"{scheduling}/c{c}", {"serve": served, "offline": row, "serve_over_offline": ratio})
            print(f"offline {scheduling:5s} c={c:<3d} output_tok_s {row['output_tok_s']:9.2f}  serve/offline "
                  f"{ratio if ratio is None else f'{ratio:.2f}'}", flush=True)
    finally:
        del llm
        gc.collect()
        if on_gpu():
            torch.cuda.empty_cache()


def print_table(results: ResultsFile, schedulings: list[str], levels: list[int]) -> None:
    print(f"\noutput tokens/s, serve (streaming clients) vs offline (in-process engine), same requests "
          f"({results.data['device']})")
    print(f"{'scheduling':>10} {'c':>4} {'serve':>10} {'offline':>10} {'serve/off':>10} {'TTFT p50 ms':>12}"
          f" {'ITL p50 ms':>11} {'ITL p99 ms':>11}")
    for scheduling in schedulings:
        for c in levels:
            r = results.results.get(f"{scheduling}/c{c}")
            if not r:
                continue
            s, o, ratio = r.get("serve") or {}, r.get("offline") or {}, r.get("serve_over_offline")
            nan = float("nan")
            print(f"{scheduling:>10} {c:>4} {s.get('output_tok_s', nan):>10.1f} {o.get('output_tok_s', nan):>10.1f}"
                  f" {ratio if ratio is not None else nan:>10.2f} {s.get('ttft_median_ms', nan):>12.2f}"
                  f" {s.get('itl_median_ms', nan):>11.3f} {s.get('itl_p99_ms', nan):>11.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the results here (after every figure)")
    parser.add_argument("--server-log", default=None, help="append the servers' logs here")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per level (default 32; CPU smoke: 8)")
    parser.add_argument("--concurrency", default=None, help="default 1,8,32 (CPU smoke: 1,8)")
    parser.add_argument("--schedulings", default=",".join(SCHEDULINGS), help="async, sync or both, in this order")
    parser.add_argument("--compile-cache", default=None, help="compile cache folder (default: a temporary one)")
    parser.add_argument("--budget-s", type=float, default=180, help="skip parts that would end later than this")
    parser.add_argument("--api-servers", type=int, default=None,
                        help="API server processes of the extra round at the highest concurrency (default 4; CPU "
                             "smoke: 2; 1: no such round)")
    args = parser.parse_args()
    # A time box's SIGTERM must still stop the server (its `finally`): left running, it would hold
    # the GPU's memory through the steps after this one.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    budget = Budget(args.budget_s)
    config = model_config()
    prompt_range, output_range, num, levels = (64, 512), (32, 256), 32, [1, 8, 32]
    if not on_gpu():
        print("no CUDA device: running a small CPU smoke version (not a measurement)")
        prompt_range, output_range, num, levels = (16, 64), (8, 16), 8, [1, 8]
    num = args.num_prompts or num
    levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else levels
    schedulings = [s.strip() for s in args.schedulings.split(",")]
    if bad := [s for s in schedulings if s not in SCHEDULINGS]:
        parser.error(f"--schedulings takes async and sync, got {bad}")
    api_servers = args.api_servers or (4 if on_gpu() else 2)
    prompts = word_prompts(num, config["vocab_size"], prompt_range, output_range)
    results = ResultsFile(args.json, num_prompts=num, levels=levels, failures=[])
    if args.server_log:
        open(args.server_log, "w").close()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dummy_model(f"{tmp}/model", config)
        cache = args.compile_cache or f"{tmp}/cache"
        round_s = 0.0
        for scheduling in schedulings:
            if round_s and not budget.allows(0.8 * round_s):  # a later round starts warm: a little faster
                results.skip(f"{scheduling}: serve and offline")
                continue
            started = time.perf_counter()
            try:
                results.data["failures"] += serve_levels(folder, cache, scheduling, prompts, levels, results,
                                                         args.server_log)
                results.write()
            except Exception:
                results.fail(f"{scheduling}: serve")
            try:
                offline_levels(folder, cache, scheduling, prompts, levels, results)
            except Exception:
                results.fail(f"{scheduling}: offline")
            round_s = max(round_s, time.perf_counter() - started)
            if scheduling == "async" and api_servers > 1:
                if not budget.allows(0.5 * round_s):
                    results.skip(f"serve with {api_servers} API servers")
                    continue
                try:
                    results.data["failures"] += serve_levels(folder, cache, scheduling, prompts, levels[-1:],
                                                             results, args.server_log, api_servers)
                    results.write()
                except Exception:
                    results.fail(f"serve with {api_servers} API servers")
    print_table(results, [k for s in schedulings for k in (s, f"{s}-api{api_servers}")], levels)
    failures = results.data["failures"] + [f"{what} failed" for what in results.errors]
    print("failures: " + ("; ".join(failures) if failures else "none"))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
