"""Batch-1 decode with speculative decoding on a GPU (issue 24): speculation off, n-gram drafts,
and the target as its own draft model (every proposal accepted: the most the draft-model method can
give at this k), on the same prompts, in one process, at -O2 (compiled pieces + CUDA graphs, with
FULL graphs for full-length verifications and for the draft's one-token steps) in bf16 on a model of
SmolLM2-135M's shape with random weights (no checkpoint travels to the GPU machine).

Random weights decide what is generated, so the n-gram acceptance here is not the bundled model's
(benchmarks/spec_decode.py measures that on a CPU); the self-draft row bounds what a draft that is
always right gains once a verification costs what it costs on this GPU.

For each engine and prompt: one warm-up request, then `--runs` timed requests of `--max-tokens`
new tokens (ignore_eos); tok/s = new tokens / wall time of `LLM.generate` (median), with the
acceptance rate and mean accepted length of the timed requests.

    python benchmarks/gpu_spec_decode.py [--json spec.json] [--compile-cache DIR] [--budget-s 120]

Without a GPU it runs a CPU smoke version (the tiny shape, -O1) that checks the script only.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time

import torch
from gpu_workload import Budget, ResultsFile, model_config, on_gpu, prompt_ids

from compiled_llm import LLM, SamplingParams
from compiled_llm.models.dummy import write_dummy_model


def workloads(vocab_size: int, prompt_len: int) -> dict[str, list[int]]:
    """A prompt that repeats one 32-token segment, and one with no repetition."""
    segment = prompt_ids(1, 32, vocab_size)[0]
    return {"repeated-prompt": (segment * (prompt_len // 32 + 1))[:prompt_len],
            "distinct-prompt": prompt_ids(2, prompt_len, vocab_size)[1]}


def engines(folder: str, k: int) -> dict[str, dict | None]:
    return {
        "off": None,
        f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 4},
        f"self-draft k={k}": {"method": "draft_model", "model": folder, "num_speculative_tokens": k},
    }


def build(folder: str, cache: str, spec: dict | None, level: int) -> LLM:
    gpu = on_gpu()
    return LLM(folder, load_format="dummy", dtype="bfloat16" if gpu else "float32", optimization_level=level,
               compile_cache=cache, max_model_len=1024, max_num_seqs=8, enable_prefix_caching=False,
               kv_cache_memory_bytes=(2 << 30) if gpu else (64 << 20), speculative_config=spec)


def measure(llm: LLM, prompt: list[int], max_tokens: int, runs: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    totals = llm.llm_engine.engine_core.scheduler.spec_totals
    drafts0, proposed0, accepted0 = totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens
    rates = []
    for _ in range(runs):
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        rates.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - started))
    drafts = totals.num_drafts - drafts0
    proposed, accepted = totals.num_draft_tokens - proposed0, totals.num_accepted_tokens - accepted0
    return {"tokens_per_s": statistics.median(rates), "runs": rates,
            "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    gpu = on_gpu()
    if not gpu:
        print("no CUDA device: running a small CPU smoke version (not a measurement)")
    level, prompt_len = (2, 128) if gpu else (1, 32)
    max_tokens = args.max_tokens or (128 if gpu else 16)
    budget = Budget(args.budget_s)
    config = model_config()
    results = ResultsFile(args.json, level=level, k=args.k, max_tokens=max_tokens, prompt_len=prompt_len)
    prompts = workloads(config["vocab_size"], prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dummy_model(f"{tmp}/model", config)
        cache = args.compile_cache or f"{tmp}/cache"
        engine_s = 0.0
        for name, spec in engines(folder, args.k).items():
            if engine_s and not budget.allows(engine_s * 1.5):
                results.skip(name)
                continue
            started = time.perf_counter()
            try:
                llm = build(folder, cache, spec, level)
                for workload, prompt in prompts.items():
                    row = measure(llm, prompt, max_tokens, args.runs)
                    results.record(f"{name}/{workload}", row)
                    print(f"{name:>16} {workload:>16}: {row['tokens_per_s']:8.1f} tok/s, acceptance "
                          f"{row['acceptance']}, mean accepted length {row['mean_accepted_length']}", flush=True)
            except Exception:
                results.fail(name)
                continue
            finally:
                engine_s = max(engine_s, time.perf_counter() - started)
            del llm
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
    rows = results.results
    for workload in prompts:
        off = rows.get(f"off/{workload}", {}).get("tokens_per_s")
        for name in engines("", args.k):
            row = rows.get(f"{name}/{workload}")
            if row and off:
                print(f"{workload}: {name} {row['tokens_per_s'] / off:.2f}x speculation off")
    sys.exit(1 if results.errors else 0)


if __name__ == "__main__":
    main()
