"""Decode speed on a GPU: eager vs -O1 (compiled pieces) vs -O2 (pieces + CUDA graphs).

A model of SmolLM2-135M's shape in bf16 with random weights; batch 1, 8 and 64, each request a
128-token prompt and 256 new tokens. Reports tokens/s and the median inter-token latency (one
decode step), and the -O2 / eager ratio. Without a GPU it runs a small smoke version on the CPU
(to check the script, not to measure).

    python benchmarks/gpu_decode.py [--json results.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback

import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.models.dummy import SMOLLM2_135M, write_dummy_model


def decode_rate(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    engine = llm.llm_engine
    for i in range(batch):
        ids = [(31 * i + j) % 40000 + 3 for j in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}-{time.time()}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # prefill (all prompts fit one step)
    steps = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    while engine.has_unfinished_requests():
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        steps.append(time.perf_counter() - t)
    itl = statistics.median(steps)
    return batch / itl, itl * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--levels", default="0,1,2")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    config, prompt_len, new_tokens = dict(SMOLLM2_135M), 128, 256
    batches = [int(b) for b in args.batches.split(",")]
    if not on_gpu:
        print("no CUDA device: running a small CPU smoke version (not a measurement)")
        config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512)
        prompt_len, new_tokens, batches = 16, 8, [1, 2]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dummy_model(f"{tmp}/model", config)
        for level in [int(x) for x in args.levels.split(",")]:
            try:
                run_level(level, folder, f"{tmp}/cache", on_gpu, batches, prompt_len, new_tokens, results, args.json)
            except Exception:  # one level failing must not hide the others' figures (one GPU try)
                traceback.print_exc()
                results[f"O{level}/error"] = {"failed": 1.0}
                write_results(args.json, on_gpu, results)
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
    print(f"\n{'batch':>6} " + " ".join(f"{'-O' + l + ' tok/s':>14}" for l in args.levels.split(",")) + "   -O2/eager")
    for batch in batches:
        row = [results.get(f"O{l}/batch{batch}", {}).get("tokens_per_s", float("nan")) for l in args.levels.split(",")]
        ratio = row[-1] / row[0] if row and row[0] else float("nan")
        print(f"{batch:>6} " + " ".join(f"{v:>14.1f}" for v in row) + f"   {ratio:9.2f}x")
    write_results(args.json, on_gpu, results)
    if any(key.endswith("/error") for key in results):
        sys.exit(1)


def run_level(level: int, folder: str, cache: str, on_gpu: bool, batches: list[int], prompt_len: int,
              new_tokens: int, results: dict[str, dict[str, float]], json_path: str | None) -> None:
    started = time.perf_counter()
    llm = LLM(folder, load_format="dummy", dtype="bfloat16" if on_gpu else "float32", optimization_level=level,
              compile_cache=cache, max_model_len=1024, max_num_seqs=max(batches),
              max_num_batched_tokens=max(512, max(batches) * prompt_len),
              kv_cache_memory_bytes=(4 << 30) if on_gpu else (64 << 20))
    print(f"-O{level}: engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    decode_rate(llm, 1, prompt_len, 8)  # warm-up
    for batch in batches:
        tok_s, itl_ms = decode_rate(llm, batch, prompt_len, new_tokens)
        results[f"O{level}/batch{batch}"] = {"tokens_per_s": tok_s, "itl_ms": itl_ms}
        print(f"-O{level} batch {batch:3d}: {tok_s:9.1f} tok/s, ITL {itl_ms:7.3f} ms", flush=True)
        write_results(json_path, on_gpu, results)  # after each figure: a timeout keeps what ran


def write_results(path: str | None, on_gpu: bool, results: dict[str, dict[str, float]]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if on_gpu else "cpu-smoke", "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
