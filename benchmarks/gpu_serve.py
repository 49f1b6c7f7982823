"""`compiled-llm serve` as a user starts it on a GPU (its defaults there: -O2, bf16, the KV cache
sized by a profiling run), on a model of SmolLM2-135M's shape with random weights, loaded by
streaming /v1/completions clients at concurrency 1, 8 and 32.

Reports, per level, requests/s, output tokens/s and median/p99 TTFT and ITL at the client, and
checks what a user relies on: every request gets all its tokens, /metrics answers, the server
logs its CUDA graphs and KV sizing, and SIGTERM ends it cleanly. Prompts are words of the model's
generated vocabulary, 64-512 tokens; outputs 32-256 tokens, EOS ignored. Without a GPU it runs a
small CPU smoke version (to check the script, not to measure).

    python benchmarks/gpu_serve.py [--json serve.json] [--server-log server.log]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile

import httpx
import torch
from serve import Server, free_port, run_level

from compiled_llm.models.dummy import SMOLLM2_135M, write_dummy_model


def word_prompts(num: int, vocab_size: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                 seed: int = 0) -> list[tuple[str, int]]:
    """Text prompts of exact token lengths for the dummy word-level tokenizer (one word, one token)."""
    rng = random.Random(seed)
    return [
        (" ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(rng.randint(*prompt_range))),
         rng.randint(*output_range))
        for _ in range(num)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--server-log", default=None, help="copy the server's log here")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", default="1,8,32")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    config = dict(SMOLLM2_135M)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompt_range, output_range, num = (64, 512), (32, 256), args.num_prompts
    if not on_gpu:
        print("no CUDA device: running a small CPU smoke version (not a measurement)")
        config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512)
        prompt_range, output_range, num, levels = (16, 64), (8, 16), 8, [1, 8]
    prompts = word_prompts(num, config["vocab_size"], prompt_range, output_range)
    results: dict[str, object] = {"device": torch.cuda.get_device_name() if on_gpu else "cpu-smoke"}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dummy_model(f"{tmp}/model", config)
        port = free_port()
        cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", folder, "--load-format", "dummy",
               "--port", str(port), "--served-model-name", "bench", "--max-model-len", "2048",
               "--no-enable-prefix-caching", "--compile-cache", f"{tmp}/cache"]
        server = Server("compiled-llm", cmd, port, "bench", {"ignore_eos": True})
        try:
            server.wait_ready()
            for c in levels:
                level = asyncio.run(run_level(server, prompts, c))
                short = [n for s, (_, n) in zip(level.samples, prompts) if s.output_tokens != n]
                if short:
                    failures.append(f"c={c}: {len(short)} requests got fewer tokens than asked")
                results[f"c{c}"] = row = level.row()
                print(f"c={c:<3d} " + "  ".join(f"{k} {v:9.2f}" for k, v in row.items()), flush=True)
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            if "compiled_llm:" not in metrics:
                failures.append("/metrics has no compiled_llm: series")
        finally:
            server.stop()
            code = server.proc.returncode
            log = open(server.log.name).read()
            if args.server_log:
                shutil.copy(server.log.name, args.server_log)
    if code != 0:
        failures.append(f"the server exited with {code} after SIGTERM")
    wanted = ["KV cache:", "Compilation (-O"] + (["GPU memory:", "CUDA graphs (FULL_AND_PIECEWISE)"] if on_gpu else [])
    failures += [f"the server log lacks {w!r}" for w in wanted if w not in log]
    print("\n".join(line for line in log.splitlines() if any(w in line for w in wanted)))
    results["failures"] = failures
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print("failures: " + ("; ".join(failures) if failures else "none"))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
