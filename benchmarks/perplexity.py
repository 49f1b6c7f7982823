"""Perplexity of every weight format, ours and llama.cpp's on the same GGUF file, on a local
English text (Python's own documentation topics, `pydoc_data.topics`: on every machine, no hub).

The text is tokenized once (the model's tokenizer) and cut into --windows windows of --window
tokens; each window is scored on its own (no context carried over), every position but its first:
perplexity = exp(mean of -log p(token | the window's tokens before it)). Both engines get the very
same token ids: ours through prompt log probabilities (`SamplingParams(prompt_logprobs=0,
max_tokens=0)`, the log probability of each prompt token), llama.cpp through its logits at every
position (peer_llama_cpp.py). The float32 path (the shipped Q4_1 file de-quantized once into
float32: the folder `compiled-llm serve -q none` serves) is the reference each row is compared with.

    python benchmarks/perplexity.py                       # F32, F16, Q8_0, Q4_1, int8, int4
    python benchmarks/perplexity.py --formats Q4_1 --windows 4
"""

from __future__ import annotations

import argparse
import gc
import math

import peer_llama_cpp
from machine import default_threads, format_machine, machine_report
from weight_formats import FILES, gguf_file


def text_ids(tok, windows: int, window: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < windows * window:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {windows} windows of {window}")
    return [ids[i * window:(i + 1) * window] for i in range(windows)]


def ours_nll(model: str, windows: list[list[int]], threads: int, **engine) -> tuple[float, int]:
    from compiled_llm import LLM, SamplingParams

    llm = LLM(model, optimization_level=1, max_model_len=max(len(w) for w in windows) + 16, num_threads=threads,
              enable_prefix_caching=False, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    total, count = 0.0, 0
    for window, out in zip(windows, outs):
        scored = out.prompt_logprobs[1:]
        assert len(scored) == len(window) - 1
        for token, position in zip(window[1:], scored):
            total -= position[token].logprob
            count += 1
    del llm
    gc.collect()
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FILES))
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--no-extras", action="store_true", help="no int8 / int4 rows")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from compiled_llm.bundled_model import bundled_model_path

    hf_folder = str(bundled_model_path())
    windows = text_ids(AutoTokenizer.from_pretrained(hf_folder), args.windows, args.window)
    print(format_machine(machine_report(args.threads)))
    print(f"text: pydoc_data.topics, {args.windows} windows of {args.window} tokens", flush=True)
    rows: list[tuple[str, float]] = []

    def add(label: str, nll: float, count: int) -> None:
        rows.append((label, math.exp(nll / count)))
        print(f"  {label}: perplexity {rows[-1][1]:.4f}", flush=True)

    add("ours float32 (the -q none folder)", *ours_nll(hf_folder, windows, args.threads, dtype="float32"))
    missing = peer_llama_cpp.missing_reason()
    for kind in [k for k in args.formats.split(",") if k]:
        path = gguf_file(kind)
        if not path.exists():
            print(f"[{kind}] {path} is missing (benchmarks/setup_llama_cpp.sh makes it): skipped")
            continue
        add(f"ours {kind} file", *ours_nll(str(path), windows, args.threads))
        if missing:
            print(f"llama.cpp: {missing}")
        else:
            peer = peer_llama_cpp.LlamaCppPeer(path, args.threads, n_ctx=args.window + 16)
            try:
                r = peer.job("nll", windows=windows)
            finally:
                peer.close()
            add(f"llama.cpp {kind} file", r["nll"], r["count"])
    if not args.no_extras:
        add("ours int8 (per channel)", *ours_nll(hf_folder, windows, args.threads, quantization="int8"))
        add("ours int4 (group 32)", *ours_nll(hf_folder, windows, args.threads, quantization="int4",
                                              quantization_options={"group_size": 32}))
        add("ours int4 (group 128)", *ours_nll(hf_folder, windows, args.threads, quantization="int4"))
    reference = rows[0][1]
    print(f"\n{'engine, format':<40}{'perplexity':>12}{'vs ours float32':>18}")
    for label, ppl in rows:
        print(f"{label:<40}{ppl:>12.4f}{100 * (ppl / reference - 1):>+17.2f}%")


if __name__ == "__main__":
    main()
