"""A plain request's latency while another client does something costly, against the same request
on an idle server, in one run (issue 21's findings 1, 2 and 4).

The server is `compiled-llm serve` on the bundled model with the issue's flags (--max-model-len 512
--max-num-seqs 64 --max-num-batched-tokens 128 --kv-cache-memory-bytes 256 MiB). The plain
request is a 2-token completion. Situations:

- idle: nothing else runs;
- costly schema: a `json_schema` nested 400 levels deep is sent (refused at once), and one just
  under the depth limit with 40 branches (allowed, about half a second of xgrammar) is compiling;
- n=128: a request with n=128, 200 tokens each (ignore_eos), is running;
- after 100 aborts: 100 chat clients with a 0.5 s timeout (and no retries) have just given up on
  long requests, as vLLM's test_request_cancellation does.

Each situation reports the median and the worst of --repeats plain requests (seconds) and the ratio
of the median to idle's.

    python benchmarks/noisy_neighbours.py [--repeats 5] [--port 8190]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
from machine import cpu_info
from serve import Server

FLAGS = ["--max-model-len", "512", "--max-num-seqs", "64", "--max-num-batched-tokens", "128",
         "--kv-cache-memory-bytes", str(256 << 20), "--served-model-name", "smol"]
PLAIN = {"model": "smol", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def schema_body(schema: dict) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


async def plain_latencies(client: httpx.AsyncClient, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        response = await client.post("/v1/completions", json=PLAIN)
        response.raise_for_status()
        times.append(time.perf_counter() - start)
    return times


async def running_requests(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("compiled_llm:num_requests_running"))


async def while_costly_schema(client: httpx.AsyncClient, repeats: int) -> list[float]:
    deep = await client.post("/v1/chat/completions", json=schema_body(nested(400)))
    assert deep.status_code == 400, deep.text
    costly = schema_body({"type": "object", "properties": {f"p{i}": nested(28) for i in range(40)}})
    times = []
    for _ in range(repeats):  # a new costly grammar each time (the cache would answer the same one)
        costly["messages"][0]["content"] += "!"
        costly["response_format"]["json_schema"]["schema"]["properties"][f"x{len(times)}"] = {"type": "string"}
        task = asyncio.create_task(client.post("/v1/chat/completions", json=costly))
        await asyncio.sleep(0.05)
        times += await plain_latencies(client, 1)
        await task
    return times


async def while_n_128(client: httpx.AsyncClient, repeats: int) -> list[float]:
    body = {"model": "smol", "prompt": "Once upon a time", "n": 128, "max_tokens": 200, "temperature": 1,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.aiter_lines()
        while await running_requests(client) < 32:  # its samples fill the running batch
            await anext(lines)
        times = await plain_latencies(client, repeats)
    return times  # leaving the stream aborts the rest


async def after_aborts(client: httpx.AsyncClient, url: str, repeats: int) -> list[float]:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Write a long story"}], "max_tokens": 400,
            "min_tokens": 400}
    async with httpx.AsyncClient(base_url=url, timeout=0.5) as impatient:
        results = await asyncio.gather(*[impatient.post("/v1/chat/completions", json=body) for _ in range(100)],
                                       return_exceptions=True)
    assert all(isinstance(r, httpx.TimeoutException) for r in results)
    return await plain_latencies(client, repeats)


async def measure(url: str, repeats: int) -> dict[str, list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await plain_latencies(client, 2)  # warm-up
        results = {"idle": await plain_latencies(client, repeats)}
        results["costly schema"] = await while_costly_schema(client, repeats)
        results["n=128"] = await while_n_128(client, repeats)
        await asyncio.sleep(2)
        results["after 100 aborts"] = await after_aborts(client, url, repeats)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=8190)
    args = parser.parse_args()
    server = Server("ours", ["compiled-llm", "serve", *FLAGS, "--port", str(args.port)], args.port, "smol", {})
    try:
        server.wait_ready()
        results = asyncio.run(measure(server.url, args.repeats))
    finally:
        server.stop()
    info = cpu_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores; plain request: 2-token completion, {args.repeats} each")
    idle = statistics.median(results["idle"])
    print("| situation | median s | worst s | median / idle |\n| --- | --- | --- | --- |")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"| {name} | {median:.3f} | {max(times):.3f} | {median / idle:.2f}x |")
    print(json.dumps({name: [round(t, 4) for t in times] for name, times in results.items()}))


if __name__ == "__main__":
    main()
