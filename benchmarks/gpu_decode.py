"""Decode speed on a GPU: eager vs -O1 (compiled pieces) vs -O2 (pieces + CUDA graphs), and the
peer, HF transformers' `generate`, on the same model and workload.

A model of SmolLM2-135M's shape in bf16 with random weights; batch 1, 8 and 64, each request a
128-token prompt and 256 new tokens (greedy, EOS ignored). Reports decode tokens/s and the
inter-token latency (one decode step), medians of `--runs` runs, and the -O2 / eager and
-O2 / HF ratios. Without a GPU it runs a small smoke version on the CPU (to check the script,
not to measure). benchmarks/gpu_profile.py measures -O2 in depth and gpu_hf_peer.py HF compiled
too; the GPU check runs this one only when asked (GPU_CHECK_STEPS=decode).

    python benchmarks/gpu_decode.py [--json results.json] [--runs 3]
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
from typing import Callable

import torch
from gpu_workload import CPU_SMOKE_SHAPE

from compiled_llm import LLM, SamplingParams
from compiled_llm.models.dummy import SMOLLM2_135M, write_dummy_model

Results = dict[str, dict[str, float]]


def prompt_ids(batch: int, prompt_len: int) -> list[list[int]]:
    return [[(31 * i + j) % 40000 + 3 for j in range(prompt_len)] for i in range(batch)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ours_decode_itl(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Median seconds of one decode step of `batch` requests (the prefill step left out)."""
    engine = llm.llm_engine
    for i, ids in enumerate(prompt_ids(batch, prompt_len)):
        engine.add_request(f"b{batch}-{i}-{time.time()}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # prefill (all prompts fit one step)
    steps = []
    while engine.has_unfinished_requests():
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        steps.append(time.perf_counter() - t)
    return statistics.median(steps)


def hf_decode_itl(model: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Seconds per decode step of HF `generate`: (time for new_tokens - time for 1) / (new_tokens - 1),
    so the prefill drops out."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompt_ids(batch, prompt_len), device=device)

    def generate(n: int) -> float:
        sync()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t

    return (generate(new_tokens) - generate(1)) / (new_tokens - 1)


def measure(name: str, itl_of: Callable[[int, int], float], batches: list[int], runs: int, results: Results,
            json_path: str | None, on_gpu: bool, new_tokens: int) -> None:
    itl_of(1, 8)  # warm-up
    for batch in batches:
        itl = statistics.median(itl_of(batch, new_tokens) for _ in range(runs))
        results[f"{name}/batch{batch}"] = {"tokens_per_s": batch / itl, "itl_ms": itl * 1e3}
        print(f"{name} batch {batch:3d}: {batch / itl:9.1f} tok/s, ITL {itl * 1e3:7.3f} ms", flush=True)
        write_results(json_path, on_gpu, results)  # after each figure: a timeout keeps what ran


def run_ours(level: int, folder: str, cache: str, on_gpu: bool, batches: list[int], prompt_len: int,
             new_tokens: int, runs: int, results: Results, json_path: str | None) -> None:
    started = time.perf_counter()
    llm = LLM(folder, load_format="dummy", dtype="bfloat16" if on_gpu else "float32", optimization_level=level,
              compile_cache=cache, max_model_len=1024, max_num_seqs=max(batches),
              max_num_batched_tokens=max(512, max(batches) * prompt_len),
              kv_cache_memory_bytes=(4 << 30) if on_gpu else (64 << 20))
    print(f"O{level}: engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    measure(f"O{level}", lambda b, n: ours_decode_itl(llm, b, prompt_len, n), batches, runs, results, json_path,
            on_gpu, new_tokens)


def run_hf(folder: str, on_gpu: bool, batches: list[int], prompt_len: int, new_tokens: int, runs: int,
           results: Results, json_path: str | None) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).to(dtype).eval()
    measure("hf", lambda b, n: hf_decode_itl(model, b, prompt_len, n), batches, runs, results, json_path, on_gpu,
            new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--levels", default="0,1,2")
    parser.add_argument("--runs", type=int, default=3, help="median of this many runs per figure")
    parser.add_argument("--no-peer", action="store_true", help="leave HF transformers out")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    config, prompt_len, new_tokens = dict(SMOLLM2_135M), 128, 256
    batches = [int(b) for b in args.batches.split(",")]
    levels = [int(x) for x in args.levels.split(",")]
    if not on_gpu:
        print("no CUDA device: running a small CPU smoke version (not a measurement)")
        config.update(CPU_SMOKE_SHAPE)
        prompt_len, new_tokens, batches = 16, 8, [1, 2]
    results: Results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dummy_model(f"{tmp}/model", config)
        jobs: list[tuple[str, Callable[[], None]]] = [
            (f"O{level}", lambda level=level: run_ours(level, folder, f"{tmp}/cache", on_gpu, batches, prompt_len,
                                                       new_tokens, args.runs, results, args.json))
            for level in levels
        ]
        if not args.no_peer:
            jobs.append(("hf", lambda: run_hf(folder, on_gpu, batches, prompt_len, new_tokens, args.runs, results,
                                              args.json)))
        for name, job in jobs:
            try:
                job()
            except Exception:  # one engine failing must not hide the others' figures (one GPU try)
                traceback.print_exc()
                results[f"{name}/error"] = {"failed": 1.0}
                write_results(args.json, on_gpu, results)
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
    names = [f"O{level}" for level in levels] + ([] if args.no_peer else ["hf"])
    best, eager = names[len(levels) - 1], names[0]
    print(f"\ndecode tokens/s, medians of {args.runs} runs ({'cuda' if on_gpu else 'cpu smoke'})")
    print(f"{'batch':>6} " + " ".join(f"{n:>10}" for n in names) + f" {best + '/' + eager:>10}"
          + ("" if args.no_peer else f" {best + '/hf':>10}"))
    for batch in batches:
        rate = {n: results.get(f"{n}/batch{batch}", {}).get("tokens_per_s", float("nan")) for n in names}
        line = f"{batch:>6} " + " ".join(f"{rate[n]:>10.1f}" for n in names) + f" {rate[best] / rate[eager]:>9.2f}x"
        if not args.no_peer:
            line += f" {rate[best] / rate['hf']:>9.2f}x"
        print(line)
    write_results(args.json, on_gpu, results)
    if any(key.endswith("/error") for key in results):
        sys.exit(1)


def write_results(path: str | None, on_gpu: bool, results: Results) -> None:
    if path:
        with open(path, "w") as f:
            device = torch.cuda.get_device_name() if on_gpu else "cpu-smoke"
            json.dump({"device": device, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
