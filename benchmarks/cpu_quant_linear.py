"""The model's linear layers, one whole pass at a time, in every weight format the CPU kernels take:
float32 (the packed GEMM), GGUF's Q8_0 and Q4_1 (groups of 32, fp16 scales as in the file), int4
quantized at load (float32 scales: groups of 32, which is Q4_1 with float32 scales, and gpt-fast's
128), and 16-bit storage (fp16, bf16), all with float32 activations.

Why whole passes: as in cpu_linear.py, a decode step reads every weight once, far more than the
caches hold, so each format gets its own copy of all the model's weights (random, the model's
shapes from its config) and one pass calls every layer's projections in order, then the output
projection. Formats take turns within each repetition, so a change in the machine's load (other
processes) falls on all of them alike; figures are medians.

Output per row count: ms per pass, the effective read rate of the weights as packed (GB/s: bytes
of the packed tensors, scales included, over the time) and GFLOP/s, per format, with the speed-up
over float32.

    python benchmarks/cpu_quant_linear.py                       # the bundled model, rows 1, 8, 32, 128
    python benchmarks/cpu_quant_linear.py --rows 1 --formats fp32,Q4_1 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from cpu_linear import model_shapes
from machine import default_threads, format_machine, machine_report

FORMATS = ["fp32", "Q8_0", "Q4_1", "int4-g32", "int4-g128", "fp16", "bf16"]

Route = Callable[[torch.Tensor], torch.Tensor]


def pack(weight: torch.Tensor, fmt: str) -> tuple[Route, int]:
    """The format's linear over `weight` packed once, and the packed bytes it reads per call."""
    from compiled_llm.kernels import quantized_reference as ref

    ops = torch.ops.compiled_llm_cpu
    n, k = weight.shape
    if fmt == "fp32":
        packed = ops.pack_linear_weight(weight, 0)
        return (lambda x: ops.packed_linear(x, packed, None, n)), packed.nbytes
    if fmt in ("fp16", "bf16"):
        packed = ops.pack_half_weight(weight.to(torch.float16 if fmt == "fp16" else torch.bfloat16), 0)
        return (lambda x: ops.half_linear(x, packed, None, n)), packed.nbytes
    quantized = {
        "Q8_0": lambda: ref.quantize_int8(weight, 32),
        "Q4_1": lambda: ref.quantize_int4(weight, 32),
        "int4-g32": lambda: ref.quantize_int4(weight, 32),
        "int4-g128": lambda: ref.quantize_int4(weight, 128),
    }[fmt]()
    bits, group = quantized.bits, quantized.group_size
    scales, mins = quantized.scales, quantized.mins
    if fmt.startswith("Q"):  # GGUF's blocks hold fp16 scales and mins, and the packed weight keeps them so
        scales, mins = scales.half(), None if mins is None else mins.half()
    packed = ops.pack_quantized_weight(quantized.q, scales, mins, bits, group, 0)
    return (lambda x: ops.quantized_linear(x, packed, None, n, k, bits, group)), packed.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--rows", default="1,8,32,128")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--reps", type=int, default=7, help="passes per figure (median)")
    parser.add_argument("--threads", type=int, default=default_threads())
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
    formats = args.formats.split(",")
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise SystemExit(f"unknown formats {sorted(unknown)}; choose from {','.join(FORMATS)}")
    print(format_machine(machine_report(args.threads)))
    g = torch.Generator().manual_seed(0)
    shapes = [(n, k) for _ in range(layers) for _, n, k in layer_shapes] + [(vocab, hidden)]
    passes: dict[str, list[tuple[int, Route]]] = {f: [] for f in formats}  # (in_features, route) in call order
    weight_bytes = dict.fromkeys(formats, 0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.02
        for f in formats:
            route, nbytes = pack(w, f)
            passes[f].append((k, route))
            weight_bytes[f] += nbytes
    flops_per_row = 2 * sum(n * k for n, k in shapes)

    for m in [int(v) for v in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in shapes}}
        times: dict[str, list[float]] = {f: [] for f in formats}
        for rep in range(args.reps + 1):
            for f in formats:
                start = clock()
                for k, route in passes[f]:
                    route(xs[k])
                if rep:  # the first pass warms up
                    times[f].append(clock() - start)
        print(f"\nrows={m}: median of {args.reps} passes ({'CPU' if args.cpu_time else 'wall'} time)")
        print(f"{'format':<11}{'ms/pass':>9}{'MB read':>9}{'GB/s':>7}{'GFLOP/s':>9}{'x fp32':>8}")
        base = statistics.median(times["fp32"]) if "fp32" in times else None
        for f in formats:
            t = statistics.median(times[f])
            speedup = f"{base / t:8.2f}" if base else f"{'':>8}"
            print(f"{f:<11}{t * 1e3:9.2f}{weight_bytes[f] / 1e6:9.1f}{weight_bytes[f] / t / 1e9:7.1f}"
                  f"{flops_per_row * m / t / 1e9:9.1f}{speedup}")


if __name__ == "__main__":
    main()
