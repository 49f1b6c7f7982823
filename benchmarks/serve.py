"""Online serving: our OpenAI server against HF transformers' own (`transformers serve`), same
load, one run, with the ratios.

Load: the throughput workload (seed 0; prompt lengths uniform in [64, 512] tokens of English-like
text, output lengths uniform in [32, 256]), greedy, ignore_eos (which `transformers serve`
refuses: its requests may stop early at EOS; its tokens/s counts the tokens it sent), as streaming
/v1/completions requests by `concurrency` clients at a time, for each concurrency level. Reported
per level: requests/s, output tokens/s, median and p99 time to first token (TTFT) and
inter-token latency (ITL), measured at the client. Both servers run the same model on this
machine, each started here as a subprocess. Our server runs without prefix caching, since every
level sends the same prompts again.

    python benchmarks/serve.py                  # levels 1, 8, 32; 64 prompts a level
    python benchmarks/serve.py --quick          # a few short requests, to check it all runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from workload import Request, throughput_workload

START_TIMEOUT_S = 600


@dataclass
class Sample:
    ttft: float
    itls: list[float]
    output_tokens: int


@dataclass
class LevelResult:
    concurrency: int
    wall: float
    samples: list[Sample] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        ttfts = sorted(s.ttft for s in self.samples)
        itls = sorted(x for s in self.samples for x in s.itls) or [float("nan")]
        tokens = sum(s.output_tokens for s in self.samples)
        return {
            "requests_per_s": len(self.samples) / self.wall,
            "output_tokens_per_s": tokens / self.wall,
            "ttft_median_ms": 1000 * statistics.median(ttfts),
            "ttft_p99_ms": 1000 * percentile(ttfts, 99),
            "itl_median_ms": 1000 * statistics.median(itls),
            "itl_p99_ms": 1000 * percentile(itls, 99),
        }


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


class Server:
    """A server subprocess; its whole process group is ended on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, model_id: str, extra_body: dict) -> None:
        self.name, self.port, self.model_id, self.extra_body = name, port, model_id, extra_body
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-bench-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready within {START_TIMEOUT_S} s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


async def one_request(http: httpx.AsyncClient, server: Server, prompt: str, output_len: int) -> Sample:
    body = {
        "model": server.model_id, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, **server.extra_body,
    }
    start = time.perf_counter()
    times: list[float] = []
    usage_tokens = None
    async with http.stream("POST", server.url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if "error" in chunk:
                raise RuntimeError(f"{server.name}: {chunk['error']}")
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError(f"{server.name} sent no text")
    return Sample(times[0] - start, [b - a for a, b in zip(times, times[1:])], usage_tokens or len(times))


async def run_level(server: Server, prompts: list[tuple[str, int]], concurrency: int) -> LevelResult:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=concurrency)) as http:
        async def bounded(prompt: str, output_len: int) -> Sample:
            async with limit:
                return await one_request(http, server, prompt, output_len)

        await bounded(prompts[0][0], 4)  # warm-up, not counted
        start = time.perf_counter()
        samples = await asyncio.gather(*(bounded(p, n) for p, n in prompts))
        return LevelResult(concurrency, time.perf_counter() - start, list(samples))


def prompts_for(tokenizer, requests: list[Request]) -> list[tuple[str, int]]:
    """Text prompts: what both servers accept."""
    return [(tokenizer.decode(r.prompt_token_ids), r.output_len) for r in requests]


def free_port() -> int:
    from compiled_llm.utils import get_open_port

    return get_open_port()


def our_server(model: str, args: argparse.Namespace) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", model, "--port", str(port),
           "--served-model-name", "bench", "--max-model-len", "2048", "--no-enable-prefix-caching"]
    if args.optimization_level is not None:
        cmd += ["-O", str(args.optimization_level)]
    if args.compile_cache:
        cmd += ["--compile-cache", args.compile_cache]
    return Server("compiled-llm", cmd, port, "bench", {"ignore_eos": True})


def hf_server(model: str) -> Server | str:
    """`transformers serve`, or why it cannot run here."""
    exe = shutil.which("transformers")
    if exe is None:
        return "the `transformers` command is not installed"
    if subprocess.run([exe, "serve", "--help"], capture_output=True, timeout=120).returncode != 0:
        return "`transformers serve` is not available in this transformers version"
    port = free_port()
    cmd = [exe, "serve", model, "--port", str(port), "--host", "127.0.0.1", "--device", "cpu", "--dtype", "float32",
           "--continuous-batching"]
    # It refuses `ignore_eos` (422), so its requests may end early at EOS; tokens/s counts what came.
    return Server("transformers-serve", cmd, port, model, {})


def bench(server: Server, prompts: list[tuple[str, int]], levels: list[int]) -> dict[int, dict[str, float]]:
    server.wait_ready()
    results = {}
    for c in levels:
        row = asyncio.run(run_level(server, prompts, c)).row()
        results[c] = row
        print(f"  {server.name:20s} c={c:<3d} " + "  ".join(f"{k} {v:9.2f}" for k, v in row.items()), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model folder (default: the bundled SmolLM2-135M-Instruct).")
    parser.add_argument("--num-prompts", type=int, default=None, help="Requests per concurrency level.")
    parser.add_argument("--concurrency", default=None, help="Comma-separated levels (default 1,8,32).")
    parser.add_argument("--quick", action="store_true", help="8 short requests a level, levels 1 and 8.")
    parser.add_argument("-O", "--optimization-level", type=int, default=None)
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--skip-hf", action="store_true", help="Only our server.")
    parser.add_argument("--json", default=None, help="Also write the results to this file.")
    args = parser.parse_args()

    model = args.model
    if model is None:
        from compiled_llm.models.bundled import bundled_model_path

        model = str(bundled_model_path())
    levels = [int(c) for c in (args.concurrency or ("1,8" if args.quick else "1,8,32")).split(",")]
    num = args.num_prompts or (8 if args.quick else 64)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ranges = dict(prompt_range=(64, 128), output_range=(16, 32)) if args.quick else {}
    prompts = prompts_for(tokenizer, throughput_workload(tokenizer, num, seed=0, **ranges))
    print(f"model {model}; {num} requests a level; concurrency {levels}; "
          f"{'quick: prompts 64-128, outputs 16-32 tokens' if args.quick else 'prompts 64-512, outputs 32-256 tokens'}")

    results: dict[str, object] = {}
    ours = our_server(model, args)
    try:
        results["compiled-llm"] = bench(ours, prompts, levels)
    finally:
        ours.stop()
    if args.skip_hf:
        results["transformers-serve"] = "skipped (--skip-hf)"
    else:
        hf = hf_server(model)
        if isinstance(hf, str):
            results["transformers-serve"] = f"not run: {hf}"
        else:
            try:
                results["transformers-serve"] = bench(hf, prompts, levels)
            except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
                results["transformers-serve"] = f"failed: {e}"
            finally:
                hf.stop()

    theirs = results["transformers-serve"]
    if isinstance(theirs, dict):
        print("ratios, compiled-llm / transformers-serve (throughput: higher is better; latency: lower is better)")
        for c in levels:
            a, b = results["compiled-llm"][c], theirs[c]
            print(f"  c={c:<3d} " + "  ".join(f"{k} {a[k] / b[k]:6.2f}x" for k in a))
    else:
        print(f"transformers-serve: {theirs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
