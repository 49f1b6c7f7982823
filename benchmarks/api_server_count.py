"""`serve --api-server-count N`: streamed output tokens/s with 1 and with N API server processes,
where the frontend, not the model, is the limit.

On a GPU the engine decodes a batch of 32 faster than one Python process can stream the tokens
(`frontend_per_token.py`: 115-130 us of the server process's CPU a streamed token here). To get
that regime on a CPU, the model is a tiny one of random weights (2 layers, hidden 64, eager), so an
engine step costs little and the server processes carry the load. `--streams` streaming clients
(in this process, each request `--output-len` tokens, EOS ignored) against the same server
command with `--api-server-count 1` and `N`, alternated over `--runs` rounds; medians. Also the
CPU time a streamed token of the server side (supervisor, API servers; not the engine core).

The clients, the engine and the API servers share this machine's cores: with 2 cores, the gain
of a second API server is bounded by the core it does not have; the GPU machine's 16 cores are
where the processes run side by side (`gpu_serve.py` runs `--api-server-count` there).

    python benchmarks/api_server_count.py [--counts 1,2] [--streams 32] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile

import psutil
from gpu_serve import word_prompts
from gpu_workload import CPU_SMOKE_SHAPE
from machine import format_machine, machine_report
from serve import Server, free_port, run_level

from compiled_llm.core.core_proc import ENGINE_PROC_TITLE
from compiled_llm.models.dummy import SMOLLM2_135M, write_dummy_model

TINY = dict(SMOLLM2_135M, **CPU_SMOKE_SHAPE)  # the GPU scripts' shrunken model


def start(folder: str, count: int, extra: list[str]) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", folder, "--load-format", "dummy",
           "--port", str(port), "--served-model-name", "bench", "--max-model-len", "1024", "-O", "0",
           "--no-enable-prefix-caching", "--num-threads", "1", "--api-server-count", str(count), *extra]
    server = Server(f"api-servers-{count}", cmd, port, "bench", {"ignore_eos": True})
    server.wait_ready()
    return server


def server_side(server: Server) -> list[psutil.Process]:
    """The supervisor (or the one server) and its API servers; not the engine core."""
    root = psutil.Process(server.proc.pid)
    return [root] + [p for p in root.children(recursive=True) if ENGINE_PROC_TITLE not in " ".join(p.cmdline())]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,2")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server-args", default="", help="more `serve` flags, e.g. '--stream-interval 4'")
    args = parser.parse_args()
    print(format_machine(machine_report(1)))
    counts = [int(c) for c in args.counts.split(",")]
    prompts = [(text, args.output_len) for text, _ in word_prompts(2 * args.streams, TINY["vocab_size"], (16, 64),
                                                                   (1, 1))]
    results: dict[int, list[tuple[float, float]]] = {c: [] for c in counts}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dummy_model(f"{tmp}/tiny", TINY)
        servers = {c: start(folder, c, args.server_args.split()) for c in counts}
        try:
            for _ in range(5):  # the other API servers may still be loading when /health first answers
                asyncio.run(run_level(servers[max(counts)], prompts[:8], 8))
            for r in range(args.runs):
                for c in counts:
                    procs = server_side(servers[c])
                    before = cpu_seconds(procs)
                    level = asyncio.run(run_level(servers[c], prompts, args.streams))
                    row = level.row()
                    us = (cpu_seconds(procs) - before) / row["output_tokens"] * 1e6
                    results[c].append((row["output_tok_s"], us))
                    print(f"run {r}: --api-server-count {c}: {row['output_tok_s']:8.0f} output tok/s, ITL median "
                          f"{row['itl_median_ms']:.2f} ms, server side {us:.0f} us of CPU a token", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    base = statistics.median(t for t, _ in results[counts[0]])
    print(f"\n{args.streams} streams, {args.output_len} tokens each, tiny model (medians of {args.runs} runs):")
    for c in counts:
        tok_s = statistics.median(t for t, _ in results[c])
        us = statistics.median(u for _, u in results[c])
        print(f"  --api-server-count {c}: {tok_s:8.0f} output tok/s ({tok_s / base:.2f}x), server side {us:.0f} us "
              f"of CPU a streamed token")


if __name__ == "__main__":
    main()
