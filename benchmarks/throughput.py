"""Offline throughput, batch-1 decode, TTFT and host time per step: our engine (-O0, -O1) against
vLLM-CPU and HF transformers, in one run, on one machine, with the same threads and dtype.

Workload (fixed, seed 0): 32 requests, prompt lengths uniform in [64, 512] tokens of English-like
text, output lengths uniform in [32, 256] (9,769 prompt and 4,900 output tokens with SmolLM2's
tokenizer), greedy, ignore_eos; figure: output tokens/s. HF runs it as a typical user would:
`generate` in batches of 8 with left padding (tokens past a request's own length are waste and
are not counted). Batch-1: a 128-token prompt and 256 new tokens; decode tokens/s = 255 / (time
to 256 tokens - time to the first token); TTFT: the same prompt with max_tokens=1, from adding
the request to its token, median of --ttft-runs. Ours and vLLM are stepped by hand the same way
(peer_vllm.step_one); HF times `generate` with 1 and with 256 new tokens.

Host time per step: the time of a decode step outside the model forward and the logits projection
(scheduling, input preparation, sampling, output processing), from timers put around both in each
engine's runner; in the batch-1 decode, and with 32 copies of its prompt decoding 32 tokens
together (b32: the steps where all 32 decode). Effective GB/s: the bytes a decode step must read (every
weight once, plus the KV cache) over the step's time, beside the machine's read bandwidth.

vLLM-CPU runs in its own venv (benchmarks/setup_vllm_cpu.sh) through peer_vllm.py; it is skipped,
with the reason printed, when the venv is missing or with --no-vllm. dtypes: float32, and
bfloat16 too where the CPU has native bf16 (avx512_bf16 or AMX in /proc/cpuinfo). Every figure
is the median of --runs runs; ratios are ours / peer (higher is better for tok/s, lower for
times).

    python benchmarks/throughput.py --runs 3
    python benchmarks/throughput.py --quick        # small workload, one run, -O1 only
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import peer_vllm
import torch
from machine import (
    decode_step_bytes,
    default_threads,
    dtypes_to_run,
    format_machine,
    machine_report,
    ratio,
    step_breakdown,
)
from peer_vllm import step_batch, step_one
from workload import english_like_ids, throughput_workload

FIGURES = (  # key, heading, format, higher is better
    ("output_tok_s", "output tok/s", "{:.1f}", True),
    ("decode_tok_s", "b1 decode tok/s", "{:.1f}", True),
    ("ttft_ms", "TTFT ms", "{:.0f}", False),
    ("step_ms", "b1 step ms", "{:.2f}", False),
    ("model_ms", "model ms", "{:.2f}", False),
    ("host_ms", "host ms/step", "{:.2f}", False),
    ("gb_s", "eff. GB/s", "{:.1f}", True),
    ("b32_step_ms", "b32 step ms", "{:.2f}", False),
    ("b32_host_ms", "b32 host ms", "{:.2f}", False),
)
BATCH, BATCH_TOKENS = 32, 32  # host time at batch 32: 32 copies of the batch-1 prompt, 32 new tokens each


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---- ours ---------------------------------------------------------------------------------------
def ours_engine(level: int, model: str | None, compile_cache: str | None, dtype: str, threads: int):
    from compiled_llm import LLM

    # No prefix caching: every run sends the same prompts again (vLLM runs without it too).
    return LLM(model, dtype=dtype, optimization_level=level, compile_cache=compile_cache, max_model_len=2048,
               num_threads=threads, enable_prefix_caching=False)


def ours_throughput(llm, requests) -> tuple[float, int]:
    from compiled_llm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(r.output_len for r in requests)
    return elapsed, tokens


class StepTimer:
    """Times our runner's model forward and logits projection (as peer_vllm does in vLLM's worker)."""

    def __init__(self, llm) -> None:
        self.events: list = []
        self.runner = runner = llm.llm_engine.engine_core.executor.driver
        forward, logits = runner.model_forward, runner.model.compute_logits
        self.saved = forward

        def timed_forward(*a, **k):
            t = time.perf_counter()
            out = forward(*a, **k)
            self.events.append(("f", t, time.perf_counter() - t, int(a[0].shape[0])))
            return out

        def timed_logits(*a, **k):
            t = time.perf_counter()
            out = logits(*a, **k)
            self.events.append(("l", t, time.perf_counter() - t))
            return out

        runner.model_forward = timed_forward
        runner.model.compute_logits = timed_logits

    def take(self) -> list:
        taken, self.events = self.events, []
        return taken

    def remove(self) -> None:
        self.runner.model_forward = self.saved
        self.runner.model.__dict__.pop("compute_logits", None)


def ours_figures(llm, requests, decode_prompt, decode_tokens: int, runs: int, ttft_runs: int) -> dict:
    from compiled_llm import SamplingParams
    from compiled_llm.sampling_params import RequestOutputKind

    engine, delta = llm.llm_engine, RequestOutputKind.DELTA
    ours_throughput(llm, requests[:4])  # warm-up
    tput = [ours_throughput(llm, requests) for _ in range(runs)]
    try:
        timer = StepTimer(llm)
    except AttributeError as e:  # the runner's layout changed: decode figures without the split
        print(f"  (no host-time split for ours: {e})")
        timer = None
    decode, steps, batch_steps = [], [], []
    for _ in range(runs):
        _, first, end, tokens = step_one(engine, decode_prompt, decode_tokens, SamplingParams, delta)
        assert tokens == decode_tokens, (tokens, decode_tokens)
        decode.append((decode_tokens - 1) / (end - first))
        if timer:
            steps.append(step_breakdown(timer.take()))
    if timer:
        for _ in range(runs):
            assert step_batch(engine, decode_prompt, BATCH, BATCH_TOKENS, SamplingParams, delta) == BATCH * BATCH_TOKENS
            batch_steps.append(step_breakdown(timer.take(), tokens=BATCH))
        timer.remove()
    ttft = []
    for _ in range(ttft_runs):
        start, first, _, _ = step_one(engine, decode_prompt, 1, SamplingParams, delta)
        ttft.append(first - start)
    return summarize([t / e for e, t in tput], decode, ttft, steps, batch_steps)


def summarize(output_tok_s, decode_tok_s, ttft_s, steps, batch_steps=()) -> dict:
    steps = [s for s in steps if s]
    batch_steps = [s for s in batch_steps if s]
    return {
        "output_tok_s": median(output_tok_s),
        "decode_tok_s": median(decode_tok_s),
        "ttft_ms": 1000 * median(ttft_s),
        "step_ms": median(s["step_ms"] for s in steps),
        "model_ms": median(s["model_ms"] for s in steps),
        "host_ms": median(s["host_ms"] for s in steps),
        "b32_step_ms": median(s["step_ms"] for s in batch_steps),
        "b32_host_ms": median(s["host_ms"] for s in batch_steps),
    }


# ---- HF transformers ----------------------------------------------------------------------------
def hf_model(model_path: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    return model, tok


@torch.inference_mode()
def hf_throughput(model, tok, requests, batch_size: int = 8) -> tuple[float, int]:
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
        new = max(r.output_len for r in batch)
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=pad)
    return time.perf_counter() - start, sum(r.output_len for r in requests)


@torch.inference_mode()
def hf_decode(model, prompt_ids, new_tokens: int) -> tuple[float, float]:
    """(decode tok/s, time to the first token)."""
    ids = torch.tensor([prompt_ids])
    kw = dict(do_sample=False, pad_token_id=0)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    first = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    total = time.perf_counter() - t
    return (new_tokens - 1) / (total - first), first


@torch.inference_mode()
def hf_ttft(model, prompt_ids) -> float:
    t = time.perf_counter()
    model.generate(torch.tensor([prompt_ids]), max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t


def hf_figures(model_path, dtype, requests, decode_prompt, decode_tokens: int, runs: int, ttft_runs: int) -> dict:
    model, hf_tok = hf_model(model_path, dtype)
    hf_decode(model, decode_prompt, 8)  # warm-up
    tput = [hf_throughput(model, hf_tok, requests) for _ in range(runs)]
    dec = [hf_decode(model, decode_prompt, decode_tokens)[0] for _ in range(runs)]
    ttft = [hf_ttft(model, decode_prompt) for _ in range(ttft_runs)]
    return summarize([t / e for e, t in tput], dec, ttft, [])


# ---- vLLM-CPU -----------------------------------------------------------------------------------
def vllm_figures(model_path, dtype, threads, requests, decode_prompt, decode_tokens, runs, ttft_runs) -> dict:
    r = peer_vllm.offline(model_path, dtype, threads, [(q.prompt_token_ids, q.output_len) for q in requests],
                          decode_prompt, decode_tokens, runs, ttft_runs, batch=BATCH, batch_tokens=BATCH_TOKENS)
    out = summarize([t / e for e, t in r["throughput"]], r["decode_tok_s"], r["ttft_s"], r["steps"],
                    r.get("batch_steps", ()))
    out["vllm"] = {k: r.get(k) for k in ("vllm", "config", "ready_from_process_start", "steps_error", "log") if k in r}
    return out


# ---- report -------------------------------------------------------------------------------------
def print_table(results: dict[str, dict], bandwidth: float) -> None:
    ours_names = [n for n in results if n.startswith("compiled-llm") and isinstance(results[n], dict)]
    peers = [n for n in results if not n.startswith("compiled-llm") and isinstance(results[n], dict)]
    width = max([len(n) for n in results] + [len(f"{a} / {b}") for a in ours_names for b in peers]) + 2
    print(f"{'engine':<{width}}" + "".join(f"{h:>17}" for _, h, _, _ in FIGURES))
    for name, r in results.items():
        if isinstance(r, str):
            print(f"{name:<{width}}  {r}")
            continue
        cells = [(fmt.format(r[k]) if r.get(k) is not None else "-") for k, _, fmt, _ in FIGURES]
        print(f"{name:<{width}}" + "".join(f"{c:>17}" for c in cells))
    print(f"(eff. GB/s: bytes a batch-1 decode step reads / b1 step time; the machine reads {bandwidth:.1f} GB/s)")
    for ours in ours_names:
        for peer in peers:
            a, b = results[ours], results[peer]
            cells = [ratio(a.get(k), b.get(k)) for k, _, _, _ in FIGURES]
            print(f"{ours + ' / ' + peer:<{width}}" + "".join(f"{c:>17}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--runs", type=int, default=None, help="runs per figure, medians reported (default 3)")
    parser.add_argument("--threads", "--num-threads", dest="threads", type=int, default=default_threads(),
                        help="threads for every engine (default: $COMPILED_LLM_NUM_THREADS or all cores)")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, or a list; auto: float32, plus bfloat16 where the CPU has native bf16")
    parser.add_argument("--levels", default=None, help="our optimization levels to run (default 0,1; --quick: 1)")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--num-requests", type=int, default=None, help="default 32 (--quick: 8)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="default 256 (--quick: 64)")
    parser.add_argument("--ttft-runs", type=int, default=5)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    parser.add_argument("--quick", action="store_true", help="8 requests, 64 decode tokens, one run, -O1 only")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    levels = [int(x) for x in (args.levels or ("1" if args.quick else "0,1")).split(",") if x != ""]
    num_requests = args.num_requests or (8 if args.quick else 32)
    decode_tokens = args.decode_tokens or (64 if args.quick else 256)
    torch.set_num_threads(args.threads)

    from compiled_llm.bundled_model import bundled_model_path

    model_path = args.model or str(bundled_model_path())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    requests = throughput_workload(tok, num_requests)
    decode_prompt = english_like_ids(tok, 128, random.Random(1))
    machine = machine_report(args.threads)
    print(format_machine(machine))
    print(f"workload: {len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens; batch-1: 128-token prompt, {decode_tokens} new "
          f"tokens; {args.threads} threads; medians of {runs} runs", flush=True)
    vllm_missing = "skipped (--no-vllm)" if args.no_vllm else peer_vllm.missing_reason()
    if vllm_missing:
        print(f"vLLM-CPU: {vllm_missing}")

    everything: dict[str, object] = {"machine": machine}
    for dtype in dtypes_to_run(args.dtype):
        step_bytes = decode_step_bytes(model_path, dtype, len(decode_prompt) + decode_tokens / 2)
        results: dict[str, dict | str] = {}
        for level in levels:
            name = f"compiled-llm -O{level}"
            print(f"[{dtype}] {name} ...", flush=True)
            llm = ours_engine(level, model_path, args.compile_cache, dtype, args.threads)
            results[name] = ours_figures(llm, requests, decode_prompt, decode_tokens, runs, args.ttft_runs)
            del llm
            gc.collect()
        if vllm_missing:
            results["vLLM-CPU"] = vllm_missing
        else:
            print(f"[{dtype}] vLLM-CPU {peer_vllm.VERSION} (its own venv and processes) ...", flush=True)
            try:
                results["vLLM-CPU"] = vllm_figures(model_path, dtype, args.threads, requests, decode_prompt,
                                                   decode_tokens, runs, args.ttft_runs)
            except RuntimeError as e:
                results["vLLM-CPU"] = f"failed: {e}"
        if args.skip_hf:
            results["HF transformers"] = "skipped (--skip-hf)"
        else:
            print(f"[{dtype}] HF transformers ...", flush=True)
            results["HF transformers"] = hf_figures(model_path, dtype, requests, decode_prompt, decode_tokens, runs,
                                                    args.ttft_runs)
        for r in results.values():
            if isinstance(r, dict) and r.get("step_ms"):
                r["gb_s"] = step_bytes / (r["step_ms"] / 1000) / 1e9
            elif isinstance(r, dict) and r.get("decode_tok_s"):
                r["gb_s"] = step_bytes * r["decode_tok_s"] / 1e9
        print(f"\n{dtype}, {args.threads} threads; a batch-1 decode step reads {step_bytes / 1e6:.0f} MB")
        print_table(results, machine["read_gb_s"])
        print(flush=True)
        everything[dtype] = results
    if args.json:
        print(json.dumps(everything))


if __name__ == "__main__":
    main()
