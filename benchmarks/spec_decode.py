"""N-gram speculative decoding on the bundled model: decode throughput with it off and on.

Two workloads built from fixed local texts (this repository's own docs and sources, so every run
sends the same prompts): a repetitive one (copy a passage, fix a typo in a function, answer with
quotes from a document), where prompt lookup should pay, and a non-repetitive one (short stories on
given topics), where it should cost little. Each at batch 1 (the requests one after another) and at
32 requests together, greedy, speculation off and on (the same engine settings otherwise). Per cell:
generated tokens per second of wall time (prefill included: the prompts are short next to the
outputs), and with speculation the acceptance rate (accepted / proposed draft tokens) and the mean
accepted length (tokens per verification, the bonus token included). llama.cpp's prompt lookup is
not driven here yet.

    python benchmarks/spec_decode.py [--max-tokens 128] [--batches 1,32] [-k 4] [-O 1] [--runs 3] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["a lighthouse keeper", "a lost robot", "a winter market", "two rival bakers", "a river journey",
          "a clockmaker's apprentice", "a storm at sea", "an old library"]


def repetitive_chats() -> list[list[dict]]:
    doc = (ROOT / "docs" / "speculative-decoding.md").read_text()
    passage = doc.split("## The `ngram` method (prompt lookup)")[1].split("##")[0].strip()
    code = (ROOT / "compiled_llm" / "spec_decode" / "ngram.py").read_text().split("class NgramIndex")[1]
    code = "class NgramIndex" + code.split("    def propose")[0]
    typo = code.replace("tokens.append(token)", "tokens.apend(token)")
    return [
        [{"role": "user", "content": f"Copy this text exactly, word for word:\n\n{passage}"}],
        [{"role": "user", "content": f"Fix the typo in this Python code and give the whole corrected code:\n\n{typo}"}],
        [{"role": "user", "content": f"Here is a document:\n\n{passage}\n\nQuote the sentences of the document "
                                     "that say how proposals are found, word for word."}],
    ]


def story_chats() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short story about {topic}."}] for topic in TOPICS]


def run_cell(llm, chats: list[list[dict]], batch: int, max_tokens: int) -> dict:
    from compiled_llm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    scheduler = llm.llm_engine.engine_core.scheduler
    totals = scheduler.spec_totals
    before = (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens)
    requests = [chats[i % len(chats)] for i in range(max(batch, len(chats)))]
    started = time.perf_counter()
    generated = 0
    if batch == 1:
        for chat in requests:
            generated += len(llm.chat([chat], params, use_tqdm=False)[0].outputs[0].token_ids)
    else:
        generated = sum(len(o.outputs[0].token_ids) for o in llm.chat(requests[:batch], params, use_tqdm=False))
    seconds = time.perf_counter() - started
    drafts, proposed, accepted = (a - b for a, b in zip(
        (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens), before))
    return {"tok_s": generated / seconds, "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_len": 1 + accepted / drafts if drafts else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("-O", "--optimization-level", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3, help="repetitions (median of the tok/s)")
    parser.add_argument("--quick", action="store_true", help="16 tokens at batch 1, one run: checks the script works")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    batches = [1] if args.quick else [int(b) for b in args.batches.split(",")]
    max_tokens = 16 if args.quick else args.max_tokens
    if args.quick:
        args.runs = 1

    from compiled_llm import LLM, SamplingParams

    workloads = {"repetitive": repetitive_chats(), "non-repetitive": story_chats()}
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}
    # Both engines live side by side and take turns within each repetition, so that the machine's
    # load (a shared machine's swings by several times) falls on both alike; medians of --runs.
    engines = {}
    for label, config in (("off", None), ("ngram", spec)):
        engines[label] = LLM(optimization_level=args.optimization_level, max_model_len=2048,
                             speculative_config=config, max_num_seqs=max(batches))
        engines[label].chat(story_chats()[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    results: dict[str, dict] = {}
    for name, chats in workloads.items():
        for batch in batches:
            cells: dict[str, list[dict]] = {label: [] for label in engines}
            for _ in range(args.runs):
                for label, llm in engines.items():
                    cells[label].append(run_cell(llm, chats, batch, max_tokens))
            for label, runs in cells.items():  # greedy: the same acceptance every run
                results[f"{name}/{batch}/{label}"] = {**runs[-1], "tok_s": statistics.median(c["tok_s"] for c in runs)}
    if args.json:
        print(json.dumps(results))
        return
    print("| workload | batch | off tok/s | ngram tok/s | speed-up | acceptance | mean accepted length |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in workloads:
        for batch in batches:
            off, on = results[f"{name}/{batch}/off"], results[f"{name}/{batch}/ngram"]
            acceptance = "-" if on["acceptance"] is None else f"{100 * on['acceptance']:.0f}%"
            length = "-" if on["mean_accepted_len"] is None else f"{on['mean_accepted_len']:.2f}"
            print(f"| {name} | {batch} | {off['tok_s']:.1f} | {on['tok_s']:.1f} | {on['tok_s'] / off['tok_s']:.2f}x "
                  f"| {acceptance} | {length} |")


if __name__ == "__main__":
    main()
