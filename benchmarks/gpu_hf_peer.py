"""The peer on a GPU: HF transformers decoding a model of the same shape (SmolLM2-135M, bf16,
random weights, built from the same config), two ways:

- `hf-generate`: plain `generate` (dynamic cache, eager PyTorch), what most users run;
- `hf-static-compiled`: `generate` with a static cache, which makes transformers compile the
  decode forward with `torch.compile(mode="reduce-overhead")` (Inductor + CUDA graphs; HF's
  default `CompileConfig`), the fastest way HF documents.

Per batch size: a 128-token prompt per row and `--new-tokens` greedy tokens (EOS ignored). The
inter-token latency is the median gap between the tokens `generate` hands its streamer (the
prefill left out), from `--runs` calls after a first one; the first call's time (for the compiled
peer: compiling and capturing) is reported as `first_call_s`. Without a GPU it runs a CPU smoke
version (tiny model; the compiled peer is compiled on the CPU too) to check the script.

Streamer gaps rather than whole-call times: one call gives every decode step, the prefill stays
out, and a median shrugs off a stray slow step. `--compile-only` makes just the compiled peer's
first call per batch, filling Inductor's on-disk caches: the GPU check runs it beside the tests,
so the measured run's compiles come from those caches (each batch size compiles anew otherwise).

    python benchmarks/gpu_hf_peer.py [--json peer.json] [--batches 1,8,32] [--budget-s 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from gpu_workload import Budget, ResultsFile, model_config, on_gpu, prompt_ids, sync

from compiled_llm.models.dummy import write_dummy_model

VARIANTS = ("hf-generate", "hf-static-compiled")


class StepClock:
    """A `generate` streamer that only notes when each step's tokens arrive (the first call is the
    prompt). It has BaseStreamer's two methods, without importing it (its home moved between
    transformers versions)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_gaps(self) -> list[float]:
        """Gaps between consecutive decode steps' tokens (prompt and prefill token left out)."""
        return [b - a for a, b in zip(self.times[2:], self.times[3:])]


def generate_kwargs(variant: str, new_tokens: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0)
    if variant == "hf-static-compiled":
        from transformers import CompileConfig

        compile_config = CompileConfig()  # HF's default: mode="reduce-overhead"
        if not on_gpu():
            compile_config._compile_all_devices = True  # HF's switch to compile on a CPU (smoke run)
        kwargs.update(cache_implementation="static", compile_config=compile_config)
    return kwargs


def measure(model: torch.nn.Module, variant: str, batch: int, prompt_len: int, new_tokens: int, runs: int,
            vocab_size: int) -> dict[str, float]:
    device = next(model.parameters()).device
    ids = torch.tensor(prompt_ids(batch, prompt_len, vocab_size), device=device)
    kwargs = generate_kwargs(variant, new_tokens)

    def call() -> tuple[float, list[float]]:
        clock = StepClock()
        sync()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock, **kwargs)  # no_grad inside
        sync()
        return time.perf_counter() - start, clock.decode_gaps()

    first_s, first_gaps = call()
    gaps = [statistics.median(call()[1]) for _ in range(runs)] or [statistics.median(first_gaps)]
    itl = statistics.median(gaps)
    return {"batch": batch, "tokens_per_s": batch / itl, "itl_ms": itl * 1e3, "first_call_s": first_s,
            "itl_ms_runs": [g * 1e3 for g in gaps]}


def build_model(folder: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    device, dtype = ("cuda", torch.bfloat16) if on_gpu() else ("cpu", torch.float32)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the results here (after every figure)")
    parser.add_argument("--batches", default=None, help="default 1,8,32 (CPU smoke: 1,2)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 (CPU smoke: 8)")
    parser.add_argument("--runs", type=int, default=3, help="median of this many calls after the first")
    parser.add_argument("--budget-s", type=float, default=150, help="skip parts that would end later than this")
    parser.add_argument("--compile-only", action="store_true", help="only the compiled peer's first call per batch")
    args = parser.parse_args()
    gpu = on_gpu()
    budget = Budget(args.budget_s)
    prompt_len, new_tokens, batches = (128, 64, [1, 8, 32]) if gpu else (16, 8, [1, 2])
    if not gpu:
        print("no CUDA device: running a small CPU smoke version (not a measurement)")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else batches
    new_tokens = args.new_tokens or new_tokens
    variants = [v.strip() for v in args.variants.split(",")]
    if bad := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants takes {', '.join(VARIANTS)}, got {bad}")
    if args.compile_only:
        variants, runs = ["hf-static-compiled"], 0
    else:
        runs = args.runs
    import transformers

    config = model_config()
    results = ResultsFile(None if args.compile_only else args.json, transformers=transformers.__version__,
                          prompt_len=prompt_len, new_tokens=new_tokens, runs=runs)
    cost = {v: 0.0 for v in variants}  # the longest batch so far (a batch size new to the compiled peer compiles)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(write_dummy_model(f"{tmp}/model", config))
        for batch in batches:  # the compiled peer first at each batch size: it is the one that matters
            for variant in sorted(variants, key=lambda v: v != "hf-static-compiled"):
                name = f"{variant}/b{batch}"
                if cost[variant] and not budget.allows(cost[variant] * 1.2):
                    results.skip(name)
                    continue
                started = time.perf_counter()
                try:
                    row = measure(model, variant, batch, prompt_len, new_tokens, runs, config["vocab_size"])
                except Exception:
                    results.fail(name)
                    continue
                cost[variant] = max(cost[variant], time.perf_counter() - started)
                results.record(name, row)
                print(f"{name}: {row['tokens_per_s']:.1f} tok/s, ITL {row['itl_ms']:.3f} ms, first call "
                      f"{row['first_call_s']:.1f} s ({time.perf_counter() - started:.1f} s)", flush=True)
    if not args.compile_only:
        print(f"\nHF transformers {transformers.__version__}, decode tok/s, medians of {runs} calls")
        print(f"{'batch':>6} " + " ".join(f"{v:>20}" for v in variants))
        for batch in batches:
            rates = [results.results.get(f"{v}/b{batch}", {}).get("tokens_per_s", float("nan")) for v in variants]
            print(f"{batch:>6} " + " ".join(f"{r:>20.1f}" for r in rates))
    sys.exit(1 if results.errors else 0)


if __name__ == "__main__":
    main()
