"""N-gram speculative decoding on the bundled model: decode throughput off and on, and llama.cpp's prompt lookup.

Two workloads built from fixed local texts (this repository's own docs and sources, so every run
sends the same prompts): a repetitive one (copy a passage, fix a typo in a function, answer with
quotes from a document), where prompt lookup should pay, and a non-repetitive one (short stories on
given topics), where it should cost little. Each at batch 1 (the requests one after another) and at
32 requests together, greedy, every request to --max-tokens (EOS ignored), speculation off and on
(the same engine settings otherwise).

Figures per cell:
- batch 1: decode tok/s, over the workload's requests sum(output tokens - 1) / sum(last token time -
  first token time) (ours: the request's metrics; llama.cpp: the generator's first and last token),
  so prefill is left out; wall tok/s (prefill included) beside it;
- 32 requests: wall tok/s, prefill included (the requests overlap, so no clean decode-only span);
- with speculation, the acceptance rate (accepted / proposed draft tokens) and the mean accepted
  length (tokens per verification, the bonus token included; drafts with no proposal not counted).

llama.cpp (peer_llama_cpp.py, llama-cpp-python in its own venv, batch 1 only) runs the same file our
engine serves (the shipped Q4_1 GGUF), with our thread count, on our prompts' token ids (rendered by
our tokenizer's chat template), greedy, through `Llama.generate` (the token stream under
create_completion(stream=True); it does not stop at EOS, so every request gets --max-tokens):
plain, and with `LlamaPromptLookupDecoding` at its defaults (max_ngram_size 2, num_pred_tokens 10)
and at num_pred_tokens = our -k; the table shows the faster of the two.

`--async-scheduling` adds both engines with asynchronous scheduling (taking turns with the others) and
a table of synchronous against asynchronous; `--no-llama-cpp` leaves llama.cpp out.

    python benchmarks/spec_decode.py [--max-tokens 128] [--batches 1,32] [-k 4] [--lookup-min 2] [--lookup-max 4]
                                     [-O 1] [--runs 3] [--quick] [--json]
                                     [--async-scheduling] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import peer_llama_cpp
from machine import default_threads, format_machine, machine_report

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
        [{"role": "user", "content": "Fix the typo in this Python code. Reply with the whole corrected code only."
                                     f"\n\n```python\n{typo}```"}],
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
    if batch == 1:
        outputs = [llm.chat([chat], params, use_tqdm=False)[0] for chat in requests]
    else:
        outputs = llm.chat(requests[:batch], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    drafts, proposed, accepted = (a - b for a, b in zip(
        (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens), before))
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    decode_tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    decode_seconds = sum(o.metrics.last_token_time - o.metrics.first_token_time for o in outputs)
    return {"tok_s": decode_tokens / decode_seconds if batch == 1 else generated / seconds,
            "wall_tok_s": generated / seconds, "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_len": 1 + accepted / drafts if drafts else None,
            "prompts": [o.prompt_token_ids for o in outputs], "tokens": [o.outputs[0].token_ids for o in outputs]}


def run_llama_cell(peer, prompts: list[list[int]], max_tokens: int, num_pred_tokens: int) -> dict:
    """llama.cpp on our prompt ids one after another (plain when num_pred_tokens is 0)."""
    runs = [peer.job("lookup_generate", prompt=p, new_tokens=max_tokens, num_pred_tokens=num_pred_tokens)
            for p in prompts]
    drafts, proposed, accepted = (sum(r[k] for r in runs) for k in ("drafts", "proposed", "accepted"))
    return {"tok_s": sum(len(r["tokens"]) - 1 for r in runs) / sum(r["end"] - r["first"] for r in runs),
            "wall_tok_s": sum(len(r["tokens"]) for r in runs) / sum(r["end"] - r["start"] for r in runs),
            "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_len": 1 + accepted / drafts if drafts else None, "tokens": [r["tokens"] for r in runs]}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions inside each pair's common prefix (1.0: the same tokens throughout)."""
    same = 0
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            if u != v:
                break
            same += 1
    return same / sum(max(len(x), len(y)) for x, y in zip(a, b))


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("-O", "--optimization-level", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3, help="repetitions (median of the tok/s)")
    parser.add_argument("--quick", action="store_true", help="16 tokens at batch 1, one run: checks the script works")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--async-scheduling", action="store_true", help="also both engines with async scheduling")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()
    batches = [1] if args.quick else [int(b) for b in args.batches.split(",")]
    max_tokens = 16 if args.quick else args.max_tokens
    if args.quick:
        args.runs = 1
    threads = default_threads()

    from compiled_llm import LLM, SamplingParams
    from compiled_llm.bundled_model import bundled_gguf_path

    workloads = {"repetitive": repetitive_chats(), "non-repetitive": story_chats()}
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    # All engines live side by side and take turns within each repetition, so that the machine's
    # load (a shared machine's swings by several times) falls on all alike; medians of --runs.
    # Warm-up on a long and a short prompt of the workloads, for every engine alike: after its first
    # long prompt llama.cpp decoded ~25x slower than at steady state here.
    warm = [repetitive_chats()[0], story_chats()[0]]
    warm_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engines = {}
    variants = [("off", None, False), ("ngram", spec, False)]
    if args.async_scheduling:
        variants += [("off async", None, True), ("ngram async", spec, True)]
    for label, config, async_scheduling in variants:
        engines[label] = LLM(optimization_level=args.optimization_level, max_model_len=2048,
                             speculative_config=config, max_num_seqs=max(batches), async_scheduling=async_scheduling)
        warm_ids = [o.prompt_token_ids for o in engines[label].chat(warm, warm_params, use_tqdm=False)]
    peer, lookups = None, {}
    missing = "left out (--no-llama-cpp)" if args.no_llama_cpp else peer_llama_cpp.missing_reason()
    if missing:
        print(f"llama.cpp: {missing}: its columns stay empty")
    else:
        peer = peer_llama_cpp.LlamaCppLookupPeer(bundled_gguf_path(), threads, n_ctx=8192)
        default_k = peer.info["draft_defaults"]["num_pred_tokens"]
        # label -> num_pred_tokens (0: plain); max_ngram_size stays at its default
        lookups = {"llama.cpp": 0, f"lookup n={default_k}": default_k}
        if args.num_speculative_tokens != default_k:
            lookups[f"lookup n={args.num_speculative_tokens}"] = args.num_speculative_tokens
        for n in lookups.values():
            for ids in warm_ids:
                peer.job("lookup_generate", prompt=ids, new_tokens=16, num_pred_tokens=n)
    machine = machine_report(threads)
    results: dict[str, dict] = {}
    for name, chats in workloads.items():
        for batch in batches:
            cells: dict[str, list[dict]] = {label: [] for label in [*engines, *(lookups if batch == 1 else ())]}
            for _ in range(args.runs):
                for label, llm in engines.items():
                    cells[label].append(run_cell(llm, chats, batch, max_tokens))
                if batch == 1:
                    for label, n in lookups.items():
                        cells[label].append(run_llama_cell(peer, cells["off"][-1]["prompts"], max_tokens, n))
            for label, runs in cells.items():  # greedy: the same tokens and acceptance every run
                results[f"{name}/{batch}/{label}"] = {**runs[-1], "tok_s": statistics.median(c["tok_s"] for c in runs),
                                                      "wall_tok_s": statistics.median(c["wall_tok_s"] for c in runs)}
    if peer is not None:
        peer.close()
    agree = {}
    for name in workloads:
        if lookups and 1 in batches:
            ours, plain = results[f"{name}/1/off"]["tokens"], results[f"{name}/1/llama.cpp"]["tokens"]
            agree[name] = {"llama.cpp_vs_ours": agreement(plain, ours),
                           **{f"{label}_vs_llama.cpp": agreement(results[f"{name}/1/{label}"]["tokens"], plain)
                              for label in lookups if label != "llama.cpp"}}
    for cell in results.values():
        cell.pop("prompts", None)
        cell.pop("tokens", None)
    if args.json:
        print(json.dumps({"machine": machine, "threads": threads, "max_tokens": max_tokens, "runs": args.runs,
                          "results": results, "greedy_agreement": agree}))
        return
    print(format_machine(machine))
    print(f"bundled SmolLM2-135M-Instruct, Q4_1 GGUF for both engines; {threads} threads; {max_tokens} tokens a "
          f"request; ours -O {args.optimization_level}, ngram k={args.num_speculative_tokens} lookup "
          f"{args.lookup_min}..{args.lookup_max}; "
          f"{peer_llama_cpp.describe()}; medians of {args.runs} runs")
    print("| workload | batch | off tok/s | ngram tok/s | speed-up | llama.cpp tok/s | llama.cpp lookup tok/s "
          "| ngram / lookup | acceptance (ours / lookup) | mean accepted length (ours / lookup) "
          "| wall tok/s off / ngram |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in workloads:
        for batch in batches:
            off, on = results[f"{name}/{batch}/off"], results[f"{name}/{batch}/ngram"]
            variants = [label for label in lookups if label != "llama.cpp" and batch == 1]
            best = max(variants, key=lambda label: results[f"{name}/1/{label}"]["tok_s"]) if variants else None
            plain = results.get(f"{name}/{batch}/llama.cpp", {})
            look = results[f"{name}/1/{best}"] if best else {}
            look_s = f"{look['tok_s']:.1f} ({best.split()[-1]})" if best else "-"
            ratio = f"{on['tok_s'] / look['tok_s']:.2f}x" if best else "-"
            print(f"| {name} | {batch} | {off['tok_s']:.1f} | {on['tok_s']:.1f} | {on['tok_s'] / off['tok_s']:.2f}x "
                  f"| {num(plain.get('tok_s'))} | {look_s} | {ratio} "
                  f"| {pct(on['acceptance'])} / {pct(look.get('acceptance'))} "
                  f"| {num(on['mean_accepted_len'], '.2f')} / {num(look.get('mean_accepted_len'), '.2f')} "
                  f"| {off['wall_tok_s']:.1f} / {on['wall_tok_s']:.1f} |")
    print("batch 1: decode tok/s (first to last token, prefill left out); 32: wall tok/s (prefill included).")
    if args.async_scheduling:
        print("\n| workload | batch | off tok/s sync / async | ngram tok/s sync / async | ngram async / sync "
              "| acceptance sync / async | mean accepted length sync / async |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name in workloads:
            for batch in batches:
                off, off_a, on, on_a = (results[f"{name}/{batch}/{label}"]
                                        for label in ("off", "off async", "ngram", "ngram async"))
                print(f"| {name} | {batch} | {off['tok_s']:.1f} / {off_a['tok_s']:.1f} "
                      f"| {on['tok_s']:.1f} / {on_a['tok_s']:.1f} | {on_a['tok_s'] / on['tok_s']:.2f}x "
                      f"| {pct(on['acceptance'])} / {pct(on_a['acceptance'])} "
                      f"| {num(on['mean_accepted_len'], '.2f')} / {num(on_a['mean_accepted_len'], '.2f')} |")
    for name, figures in agree.items():
        cells = "; ".join(f"{label}: {results[f'{name}/1/{label}']['tok_s']:.1f} tok/s, "
                          f"{pct(results[f'{name}/1/{label}']['acceptance'])} accepted"
                          for label in lookups if label != "llama.cpp")
        print(f"{name}, batch 1: llama.cpp prompt lookup {cells}; greedy tokens in common prefix: "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in figures.items()))


if __name__ == "__main__":
    main()
