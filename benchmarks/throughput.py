"""Offline throughput and batch-1 decode: our engine (-O0, -O1) against HF transformers, in one run.

Workload (fixed, seed 0): 32 requests, prompt lengths uniform in [64, 512] tokens of English-like
text, output lengths uniform in [32, 256], greedy, ignore_eos. HF runs it as a typical user
would: `generate` in batches of 8 with left padding (tokens past a request's own length are
waste and are not counted). Batch-1 decode: a 128-token prompt and 256 new tokens; decode
tokens/s = 255 / (time to 256 tokens - time to the first token).

    python benchmarks/throughput.py --runs 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from workload import english_like_ids, throughput_workload

import random


def ours_engine(level: int, model: str | None, compile_cache: str | None):
    from compiled_llm import LLM

    return LLM(model, optimization_level=level, compile_cache=compile_cache, max_model_len=2048, num_threads=torch.get_num_threads())


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


def ours_decode(llm, prompt_ids, new_tokens: int) -> float:
    from compiled_llm import SamplingParams

    engine = llm.llm_engine
    engine.add_request(f"decode-{time.time()}", {"prompt_token_ids": prompt_ids},
                       SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    first = None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and outs:
            first = time.perf_counter()
    end = time.perf_counter()
    del start
    return (new_tokens - 1) / (end - first)


def hf_model(model_path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
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
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start, sum(r.output_len for r in requests)


@torch.inference_mode()
def hf_decode(model, prompt_ids, new_tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    kw = dict(do_sample=False, pad_token_id=0)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    first = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    total = time.perf_counter() - t
    return (new_tokens - 1) / (total - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--levels", default="0,1", help="our optimization levels to run")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from compiled_llm.models.bundled import bundled_model_path

    model_path = args.model or str(bundled_model_path())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    requests = throughput_workload(tok, args.num_requests)
    decode_prompt = english_like_ids(tok, 128, random.Random(1))
    print(f"workload: {len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens; {args.threads} threads; medians of {args.runs} runs")

    results: dict[str, dict[str, float]] = {}
    for level in [int(x) for x in args.levels.split(",") if x != ""]:
        llm = ours_engine(level, model_path, args.compile_cache)
        ours_throughput(llm, requests[:4])  # warm-up
        tput = [ours_throughput(llm, requests) for _ in range(args.runs)]
        dec = [ours_decode(llm, decode_prompt, args.decode_tokens) for _ in range(args.runs)]
        results[f"compiled-llm -O{level}"] = {
            "output_tok_s": statistics.median(t / e for e, t in tput),
            "decode_tok_s": statistics.median(dec),
        }
        del llm
        gc.collect()
    if not args.skip_hf:
        model, hf_tok = hf_model(model_path)
        hf_decode(model, decode_prompt, 8)  # warm-up
        tput = [hf_throughput(model, hf_tok, requests) for _ in range(args.runs)]
        dec = [hf_decode(model, decode_prompt, args.decode_tokens) for _ in range(args.runs)]
        results["HF transformers"] = {
            "output_tok_s": statistics.median(t / e for e, t in tput),
            "decode_tok_s": statistics.median(dec),
        }
    base = results.get("HF transformers")
    print(f"{'engine':<20} {'output tok/s':>14} {'x HF':>7} {'batch-1 decode tok/s':>22} {'x HF':>7}")
    for name, r in results.items():
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}" if base else "-"
        dratio = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}" if base else "-"
        print(f"{name:<20} {r['output_tok_s']:>14.1f} {ratio:>7} {r['decode_tok_s']:>22.1f} {dratio:>7}", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
