"""Online serving: our OpenAI server against vLLM-CPU's and HF transformers' (`transformers serve`),
same load, one run, with the ratios.

Load: `vllm bench serve` (from vLLM's venv, benchmarks/setup_vllm_cpu.sh) is the one client for
every server: random prompts of 256 tokens, 128 output tokens, ignore_eos, greedy, streaming
/v1/completions, `--max-concurrency` 1, 8 and 32 (max(16, 4 x concurrency) prompts a level, one
warm-up request). `transformers serve` refuses fields `vllm bench serve` always sends
(repetition_penalty) and ignore_eos (422 both), so a built-in client drives it with English-like
prompts of the same lengths, without ignore_eos: its requests may end early at EOS and its tokens/s
counts what came. Reported per level:
output tokens/s, requests/s, median and p99 time to first token (TTFT), inter-token latency (ITL)
and time per output token (TPOT), measured at the client; medians of --runs runs.

The servers run one after another on this machine, each started here as a subprocess with the
same model, dtype and threads: ours is `compiled-llm serve --num-threads N`; vLLM's is
`python -m vllm.entrypoints.openai.api_server` with VLLM_CPU_OMP_THREADS_BIND=0-<N-1> and
VLLM_CPU_KVCACHE_SPACE=4. Both run without prefix caching, since every level sends the same
prompts again. Without vLLM's venv (or with --client builtin) a built-in client sends the same
shape of load (English-like prompts of 256 tokens, 128 output tokens) and vLLM is left out.

    python benchmarks/serve.py                  # levels 1, 8, 32
    python benchmarks/serve.py --quick          # 8 short requests a level, levels 1 and 8, one run
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
import peer_vllm
from machine import default_threads, dtypes_to_run, ratio
from workload import Request, throughput_workload

START_TIMEOUT_S = 900
FIGURES = (  # key, heading, higher is better
    ("output_tok_s", "output tok/s", True),
    ("req_s", "req/s", True),
    ("ttft_median_ms", "TTFT p50 ms", False),
    ("ttft_p99_ms", "TTFT p99 ms", False),
    ("itl_median_ms", "ITL p50 ms", False),
    ("itl_p99_ms", "ITL p99 ms", False),
    ("tpot_median_ms", "TPOT p50 ms", False),
)


# ---- servers ------------------------------------------------------------------------------------
class Server:
    """A server subprocess; its whole process group is ended on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, model_id: str, extra_body: dict,
                 env: dict | None = None, ignore_eos: bool = True, bench_client: bool = True) -> None:
        self.name, self.port, self.model_id, self.extra_body = name, port, model_id, extra_body
        self.ignore_eos, self.bench_client = ignore_eos, bench_client
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-bench-{name}-", suffix=".log", delete=False)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def wait_ready(self) -> float:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
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
        try:  # what the server left (an engine-core or worker process) goes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    from compiled_llm.utils import get_open_port

    return get_open_port()


def our_server(model: str, args: argparse.Namespace, dtype: str, extra: tuple[str, ...] = ()) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", model, "--port", str(port),
           "--served-model-name", "bench", "--max-model-len", "2048", "--no-enable-prefix-caching",
           "--dtype", dtype, "--num-threads", str(args.threads), *extra]
    if args.optimization_level is not None:
        cmd += ["-O", str(args.optimization_level)]
    if args.compile_cache:
        cmd += ["--compile-cache", args.compile_cache]
    env = {**os.environ, "COMPILED_LLM_NUM_THREADS": str(args.threads)}
    return Server("compiled-llm", cmd, port, "bench", {"ignore_eos": True}, env)


def vllm_server(model: str, args: argparse.Namespace, dtype: str) -> Server:
    port = free_port()
    return Server("vLLM-CPU", peer_vllm.server_cmd(model, port, dtype), port, "bench", {"ignore_eos": True},
                  peer_vllm.vllm_env(args.threads))


def hf_server(model: str, dtype: str) -> Server | str:
    """`transformers serve`, or why it cannot run here."""
    exe = shutil.which("transformers")
    if exe is None:
        return "the `transformers` command is not installed"
    if subprocess.run([exe, "serve", "--help"], capture_output=True, timeout=120).returncode != 0:
        return "`transformers serve` is not available in this transformers version"
    port = free_port()
    cmd = [exe, "serve", model, "--port", str(port), "--host", "127.0.0.1", "--device", "cpu", "--dtype", dtype,
           "--continuous-batching"]
    # It refuses `ignore_eos` (422), so its requests may end early at EOS; tokens/s counts what came.
    # It also refuses the `repetition_penalty` that `vllm bench serve` always sends ("Unexpected
    # fields in the request"), so the built-in client drives it.
    return Server("transformers-serve", cmd, port, model, {}, ignore_eos=False, bench_client=False)


# ---- client: vllm bench serve -------------------------------------------------------------------
def vllm_bench_level(server: Server, tokenizer: str, c: int, num: int, input_len: int, output_len: int) -> dict:
    r = peer_vllm.bench_serve(server.port, tokenizer, c, num, input_len, output_len, served_name=server.model_id,
                              ignore_eos=server.ignore_eos)
    if r.get("failed"):
        raise RuntimeError(f"{server.name}: {r['failed']} of {r['failed'] + r['completed']} requests failed")
    return {
        "output_tok_s": r["output_throughput"], "req_s": r["request_throughput"],
        "ttft_median_ms": r["median_ttft_ms"], "ttft_p99_ms": r.get("p99_ttft_ms"),
        "itl_median_ms": r["median_itl_ms"], "itl_p99_ms": r.get("p99_itl_ms"),
        "tpot_median_ms": r["median_tpot_ms"], "output_tokens": r["total_output_tokens"],
        "input_tokens": r["total_input_tokens"], "completed": r["completed"],
    }


# ---- client: built in (without vLLM's venv) -----------------------------------------------------
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
            "output_tok_s": tokens / self.wall,
            "req_s": len(self.samples) / self.wall,
            "ttft_median_ms": 1000 * statistics.median(ttfts),
            "ttft_p99_ms": 1000 * percentile(ttfts, 99),
            "itl_median_ms": 1000 * statistics.median(itls),
            "itl_p99_ms": 1000 * percentile(itls, 99),
            "output_tokens": tokens,
        }


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


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
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
        async def bounded(prompt: str, output_len: int) -> Sample:
            async with limit:
                return await one_request(http, server, prompt, output_len)

        await bounded(prompts[0][0], 4)  # warm-up, not counted
        start = time.perf_counter()
        samples = await asyncio.gather(*(bounded(p, n) for p, n in prompts))
        return LevelResult(concurrency, time.perf_counter() - start, list(samples))


def prompts_for(tokenizer, requests: list[Request]) -> list[tuple[str, int]]:
    """Text prompts: what every server accepts."""
    return [(tokenizer.decode(r.prompt_token_ids), r.output_len) for r in requests]


# ---- the run ------------------------------------------------------------------------------------
def bench(server: Server, levels: list[int], runs: int, level_fn) -> dict[int, dict[str, float]]:
    ready = server.wait_ready()
    print(f"  {server.name} ready {ready:.1f} s after its start", flush=True)
    results = {}
    for c in levels:
        rows = []
        for i in range(runs):
            rows.append(level_fn(server, c))
            print(f"  {server.name:20s} c={c:<3d} run {i + 1}: " +
                  "  ".join(f"{k} {v:.2f}" for k, v in rows[-1].items() if v is not None), flush=True)
        results[c] = {k: statistics.median(r[k] for r in rows) for k in rows[0] if rows[0][k] is not None}
    return results


def print_tables(results: dict[str, object], levels: list[int]) -> None:
    names = list(results)
    width = max(len(n) for n in names) + max(len(" / vLLM-CPU"), 2) + 14
    for c in levels:
        print(f"concurrency {c}")
        print(f"  {'server':<{width}}" + "".join(f"{h:>14}" for _, h, _ in FIGURES))
        for name in names:
            r = results[name]
            if not isinstance(r, dict):
                print(f"  {name:<{width}}{r}")
                continue
            row = r[c]
            cells = (f"{row[k]:>14.1f}" if k in row else f"{'-':>14}" for k, _, _ in FIGURES)
            print(f"  {name:<{width}}" + "".join(cells))
        ours = results.get("compiled-llm")
        for peer in names[1:]:
            if isinstance(ours, dict) and isinstance(results[peer], dict):
                a, b = ours[c], results[peer][c]
                cells = (f"{ratio(a.get(k), b.get(k)):>14}" for k, _, _ in FIGURES)
                print(f"  {'compiled-llm / ' + peer:<{width}}" + "".join(cells))
    print("(ratios ours / peer: throughput higher is better; latency lower is better)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model folder (default: the bundled SmolLM2-135M-Instruct).")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="Requests per concurrency level (default max(16, 4 x concurrency); --quick: 8).")
    parser.add_argument("--concurrency", default=None, help="Comma-separated levels (default 1,8,32).")
    parser.add_argument("--input-len", type=int, default=None, help="Prompt tokens (default 256; --quick: 64).")
    parser.add_argument("--output-len", type=int, default=None, help="Output tokens (default 128; --quick: 16).")
    parser.add_argument("--runs", type=int, default=None,
                        help="Runs per level, medians reported (default 3; --quick: 1).")
    parser.add_argument("--quick", action="store_true", help="8 short requests a level, levels 1 and 8, one run.")
    parser.add_argument("-O", "--optimization-level", type=int, default=None)
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--threads", "--num-threads", dest="threads", type=int, default=default_threads())
    parser.add_argument("--dtype", default="auto", help="auto: float32, plus bfloat16 where the CPU has native bf16")
    parser.add_argument("--client", choices=["auto", "vllm-bench", "builtin"], default="auto",
                        help="auto: `vllm bench serve` when vLLM's venv exists, else the built-in client.")
    parser.add_argument("--no-vllm", action="store_true", help="Leave vLLM-CPU's server out.")
    parser.add_argument("--skip-hf", action="store_true", help="Leave `transformers serve` out.")
    parser.add_argument("--json", default=None, help="Also write the results to this file.")
    args = parser.parse_args()

    model = args.model
    if model is None:
        from compiled_llm.bundled_model import bundled_model_path

        model = str(bundled_model_path())
    levels = [int(c) for c in (args.concurrency or ("1,8" if args.quick else "1,8,32")).split(",")]
    runs = args.runs or (1 if args.quick else 3)
    input_len = args.input_len or (64 if args.quick else 256)
    output_len = args.output_len or (16 if args.quick else 128)

    def num_prompts(c: int) -> int:
        return args.num_prompts or (8 if args.quick else max(16, 4 * c))

    missing = peer_vllm.missing_reason()
    client = args.client if args.client != "auto" else ("builtin" if missing else "vllm-bench")
    if client == "vllm-bench" and missing:
        sys.exit(f"--client vllm-bench: {missing}")
    vllm_skip = "skipped (--no-vllm)" if args.no_vllm else (f"not run: {missing}" if missing else None)
    prompts: dict[int, list[tuple[str, int]]] = {}

    def builtin_level(server: Server, c: int) -> dict:
        if c not in prompts:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
            ranges = dict(prompt_range=(input_len, input_len), output_range=(output_len, output_len))
            prompts[c] = prompts_for(tokenizer, throughput_workload(tokenizer, num_prompts(c), seed=0, **ranges))
        return asyncio.run(run_level(server, prompts[c], c)).row()

    def level_fn(server: Server, c: int) -> dict:
        if client == "vllm-bench" and server.bench_client:
            return vllm_bench_level(server, model, c, num_prompts(c), input_len, output_len)
        return builtin_level(server, c)

    if client == "vllm-bench":
        load = (f"`vllm bench serve` random prompts, {input_len} in / {output_len} out "
                "(transformers-serve: built-in client, English-like prompts, same lengths, no ignore_eos)")
    else:
        load = f"built-in client, English-like prompts, {input_len} in / {output_len} out"
    print(f"model {model}; {load}; concurrency {levels} with {[num_prompts(c) for c in levels]} requests; "
          f"{args.threads} threads; medians of {runs} runs")
    if vllm_skip:
        print(f"vLLM-CPU: {vllm_skip}")

    everything = {}
    for dtype in dtypes_to_run(args.dtype):
        print(f"[{dtype}]", flush=True)
        results: dict[str, object] = {}
        starters = [("compiled-llm", lambda dtype=dtype: our_server(model, args, dtype))]
        if vllm_skip:
            results["vLLM-CPU"] = vllm_skip
        else:
            starters.append(("vLLM-CPU", lambda dtype=dtype: vllm_server(model, args, dtype)))
        if args.skip_hf:
            results["transformers-serve"] = "skipped (--skip-hf)"
        else:
            starters.append(("transformers-serve", lambda dtype=dtype: hf_server(model, dtype)))
        for name, start in starters:
            server = start()
            if isinstance(server, str):
                results[name] = f"not run: {server}"
                continue
            try:
                results[name] = bench(server, levels, runs, level_fn)
            except (RuntimeError, TimeoutError, httpx.HTTPError, subprocess.TimeoutExpired) as e:
                if name == "compiled-llm":
                    raise
                results[name] = f"failed: {e}"
                print(f"  {name} failed: {e}", flush=True)
            finally:
                server.stop()
        ordered = {n: results[n] for n in ("compiled-llm", "vLLM-CPU", "transformers-serve") if n in results}
        print(f"\n{dtype}, {args.threads} threads; {load}")
        print_tables(ordered, levels)
        print(flush=True)
        everything[dtype] = ordered
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=2)


if __name__ == "__main__":
    main()
