"""The Responses API's streaming cost against chat completions': the same requests streamed through
`POST /v1/responses` and `POST /v1/chat/completions` of one server, in interleaved rounds.

One `compiled-llm serve` (the bundled model, -O1, `--num-threads`), `--requests` requests a round
at `--concurrency`, each the same user message and `--max-tokens` output tokens (ignore_eos,
greedy: both APIs generate the same tokens). Per round: output tokens/s at the client (the tokens
counted by each stream's final usage, over the round's wall time) and the CPU time the server's own
process (the frontend: HTTP, the handlers, AsyncLLM; not the engine core) spent per output token.
Rounds alternate chat, responses, chat, ... so that a machine's drift hits both; medians of
`--runs` rounds each, and the median of the rounds' ratios responses / chat (each Responses round
against the chat round just before it). The frontend's CPU time is read in clock ticks (10 ms):
about 5% of a round's.

    python benchmarks/responses_stream.py [--requests 16] [--concurrency 8] [--max-tokens 64] [--runs 3]
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
import psutil
from machine import default_threads

from compiled_llm.utils import get_open_port

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
START_TIMEOUT_S = 900


def start_server(threads: int) -> tuple[subprocess.Popen, str, str]:
    port = get_open_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="responses-bench-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", "--served-model-name", "m",
           "--num-threads", str(threads), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready in {START_TIMEOUT_S} s; log: {log.name}")


def body(api: str, max_tokens: int) -> dict:
    common = {"model": "m", "temperature": 0, "ignore_eos": True, "stream": True}
    if api == "chat":
        return {**common, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                "stream_options": {"include_usage": True}}
    return {**common, "input": PROMPT, "max_output_tokens": max_tokens}


async def one_stream(client: httpx.AsyncClient, url: str, api: str, max_tokens: int) -> int:
    """The output tokens of one streamed request, by its final usage."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/responses"
    tokens = 0
    async with client.stream("POST", url + path, json=body(api, max_tokens)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if api == "chat" and '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif api == "responses" and line.startswith('data: {"type":"response.completed"'):
                tokens = json.loads(line[6:])["response"]["usage"]["output_tokens"]
    return tokens


async def run_round(url: str, api: str, requests: int, concurrency: int, max_tokens: int,
                    server: psutil.Process) -> dict:
    limit = asyncio.Semaphore(concurrency)

    async def limited(client: httpx.AsyncClient) -> int:
        async with limit:
            return await one_stream(client, url, api, max_tokens)

    async with httpx.AsyncClient(timeout=600) as client:
        cpu0, t0 = sum(server.cpu_times()[:2]), time.perf_counter()
        counts = await asyncio.gather(*(limited(client) for _ in range(requests)))
        seconds, cpu = time.perf_counter() - t0, sum(server.cpu_times()[:2]) - cpu0
    tokens = sum(counts)
    assert tokens == requests * max_tokens, (api, counts)
    return {"tok_s": tokens / seconds, "frontend_us_per_token": 1e6 * cpu / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=default_threads())
    args = parser.parse_args()
    proc, url, log = start_server(args.threads)
    try:
        server = psutil.Process(proc.pid)
        for api in ("chat", "responses"):  # warm-up: the first requests of each API pay one-time costs
            asyncio.run(run_round(url, api, 2, 2, 8, server))
        results: dict[str, list[dict]] = {"chat": [], "responses": []}
        for run in range(args.runs):
            for api in ("chat", "responses"):
                r = asyncio.run(run_round(url, api, args.requests, args.concurrency, args.max_tokens, server))
                results[api].append(r)
                print(f"run {run + 1} {api:9s} {r['tok_s']:7.1f} tok/s  frontend {r['frontend_us_per_token']:6.0f} "
                      "us CPU/token", flush=True)
        med = {api: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for api, rs in results.items()}
        print(f"\n{args.requests} requests, concurrency {args.concurrency}, {args.max_tokens} tokens each, "
              f"{args.threads} threads, medians of {args.runs}:")
        for api, m in med.items():
            print(f"  {api:9s} {m['tok_s']:7.1f} tok/s, frontend {m['frontend_us_per_token']:.0f} us CPU/token")
        # Each Responses round beside the chat round just before it: a drifting machine load moves both.
        pairs = {k: statistics.median(r[k] / c[k] for r, c in zip(results["responses"], results["chat"]))
                 for k in ("tok_s", "frontend_us_per_token")}
        print(f"  responses / chat, median of the rounds' ratios: {pairs['tok_s']:.3f}x tok/s, "
              f"{pairs['frontend_us_per_token']:.2f}x frontend CPU/token")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        print(f"server log: {log}")


if __name__ == "__main__":
    main()
