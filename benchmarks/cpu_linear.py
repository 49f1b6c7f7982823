"""The linear layers of a model, one whole pass at a time, by every CPU route the engine could take.

Why whole passes: a decode step reads every weight of the model once, far more than the caches
hold, so a benchmark that calls one layer again and again (its weight then sits in L3) flatters
every route. Here each route gets its own copy of all the model's weights (random, the model's
shapes from its config), and one pass calls every layer's projections in the model's order, then
the output projection. Figures per shape kind are summed over the layers.

Routes: `F.linear` (MKL); oneDNN with the weight prepacked once (`torch.ops.mkldnn`, what
vLLM-CPU does); the project's packed GEMM (`compiled_llm_cpu::packed_linear`, weights packed at
load). Output: ms per pass, the effective weight read rate (GB/s) and GFLOP/s, per route and
row count; the fastest route per shape kind and row count is marked.

    python benchmarks/cpu_linear.py                      # the bundled model, rows 1..512
    python benchmarks/cpu_linear.py --rows 1,8 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from machine import default_threads, format_machine, machine_report


def model_shapes(folder: str) -> tuple[int, list[tuple[str, int, int]], tuple[int, int]]:
    """(layers, [(kind, out, in)] of one layer, (vocab, hidden) of the output projection)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads)
    inter = cfg["intermediate_size"]
    layer = [("qkv", (heads + 2 * kv) * head_dim, hidden), ("o", hidden, heads * head_dim),
             ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]
    return cfg["num_hidden_layers"], layer, (cfg["vocab_size"], hidden)


Route = Callable[[torch.Tensor], torch.Tensor]


def routes_for(weight: torch.Tensor, names: list[str]) -> dict[str, Route]:
    out: dict[str, Route] = {}
    n = weight.shape[0]
    if "F.linear" in names:
        out["F.linear"] = lambda x, w=weight: F.linear(x, w)
    if "onednn-packed" in names:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        out["onednn-packed"] = lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    if "packed" in names:
        packed = torch.ops.compiled_llm_cpu.pack_linear_weight(weight)
        out["packed"] = lambda x, p=packed, n=n: torch.ops.compiled_llm_cpu.packed_linear(x, p, None, n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--rows", default="1,4,8,16,32,64,256,512")
    parser.add_argument("--routes", default="F.linear,onednn-packed,packed")
    parser.add_argument("--reps", type=int, default=7, help="passes per figure (median)")
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--best", action="store_true",
                        help="the fastest pass instead of the median (on a machine others load: noise only adds)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this thread's CPU time, not wall time: with --threads 1 on a machine others "
                             "load, time spent descheduled is left out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time needs --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    from compiled_llm.kernels.cpu_extension import cpu_kernels_available

    if not cpu_kernels_available():
        raise SystemExit("the C++ CPU kernels could not be built")
    from compiled_llm.bundled_model import bundled_model_path

    layers, layer_shapes, (vocab, hidden) = model_shapes(args.model or str(bundled_model_path()))
    names = args.routes.split(",")
    print(format_machine(machine_report(args.threads)))
    g = torch.Generator().manual_seed(0)
    # Per route: [(kind, route)] in call order over the whole model.
    passes: dict[str, list[tuple[str, int, int, Route]]] = {r: [] for r in names}
    for _ in range(layers):
        for kind, n, k in layer_shapes:
            w = torch.randn(n, k, generator=g) * 0.02
            for r, fn in routes_for(w, names).items():
                passes[r].append((kind, n, k, fn))
    head = torch.randn(vocab, hidden, generator=g) * 0.02
    for r, fn in routes_for(head, names).items():
        passes[r].append(("lm_head", vocab, hidden, fn))
    kinds = [k for k, _, _ in layer_shapes] + ["lm_head"]

    for m in [int(v) for v in args.rows.split(",")]:
        xs = {k: torch.randn(m, kk, generator=g) for k, _, kk in layer_shapes}
        xs["lm_head"] = torch.randn(m, hidden, generator=g)
        results: dict[str, dict[str, float]] = {}
        for r in names:
            per_kind: dict[str, list[float]] = {k: [] for k in kinds}
            totals = []
            for rep in range(args.reps + 1):
                acc = dict.fromkeys(kinds, 0.0)
                start = clock()
                for kind, _, _, fn in passes[r]:
                    t = clock()
                    fn(xs[kind])
                    acc[kind] += clock() - t
                total = clock() - start
                if rep:  # the first pass warms up
                    totals.append(total)
                    for k in kinds:
                        per_kind[k].append(acc[k])
            stat = min if args.best else statistics.median
            results[r] = {k: stat(v) for k, v in per_kind.items()}
            results[r]["total"] = stat(totals)
        bytes_of = {k: sum(n * kk * 4 for kind, n, kk, _ in passes[names[0]] if kind == k) for k in kinds}
        bytes_of["total"] = sum(bytes_of.values())
        print(f"\nrows={m}: {'best' if args.best else 'median'} ms per pass (GB/s of weights, GFLOP/s); * = fastest")
        cols = kinds + ["total"]
        print(f"{'route':<15}" + "".join(f"{c:>24}" for c in cols))
        best = {c: min(results, key=lambda r: results[r][c]) for c in cols}
        for r, res in results.items():
            cells = []
            for c in cols:
                t = res[c]
                gbs, gflops = bytes_of[c] / t / 1e9, bytes_of[c] / 4 * 2 * m / t / 1e9
                cells.append(f"{'*' if best[c] == r else ' '}{t * 1e3:7.2f} ({gbs:5.1f}, {gflops:5.0f})")
            print(f"{r:<15}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
