"""Cold start vs warm start, ours against vLLM-CPU: time from process start to ready (the engine
built) and to the first token, and our compile phase alone.

Each run is a fresh Python process building the engine with a compile-cache folder: empty for a
cold start, the one the cold start filled for a warm start. Ours: `LLM` at -O1 (or -O given)
with `compile_cache=<folder>`. vLLM-CPU (its own venv, through peer_vllm.py): `LLM` with
VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR in the folder, VLLM_CPU_OMP_THREADS_BIND=0-<N-1>.
Both: same model, dtype and threads; the first token is a 1-token generate of "Hello". Figures are
medians of --runs runs; ratios are ours / vLLM (lower is better).

    python benchmarks/startup.py --runs 3
    python benchmarks/startup.py --quick        # one run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import peer_vllm
from machine import default_threads, dtypes_to_run, ratio

PROBE = r"""
import json, sys, time, psutil
started = psutil.Process().create_time()
from compiled_llm import LLM, SamplingParams
llm = LLM(sys.argv[1] if sys.argv[1] != "-" else None, optimization_level=int(sys.argv[2]), compile_cache=sys.argv[3],
          max_model_len=2048, num_threads=int(sys.argv[4]), dtype=sys.argv[5])
ready = time.time()
llm.generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)
first_token = time.time()
runner = llm.llm_engine.engine_core.executor.driver
compiled = getattr(runner, "compiled_forward", None)
print(json.dumps({
    "ttft_from_process_start": first_token - started,
    "ready_from_process_start": ready - started,
    "compile_phase": compiled.seconds if compiled else 0.0,
    "inductor_compilations": compiled.report.inductor_compilations if compiled else 0,
    "artifacts_loaded": compiled.report.artifacts_loaded if compiled else 0,
}))
"""


def run_probe(model: str | None, level: int, cache: str, threads: int, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, model or "-", str(level), cache, str(threads), dtype],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "COMPILED_LLM_LOG_LEVEL": "WARNING",
                              "COMPILED_LLM_NUM_THREADS": str(threads)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_vllm(model: str, cache: str, threads: int, dtype: str) -> dict:
    r = peer_vllm.startup(model, dtype, threads, cache)
    return {k: r[k] for k in ("ready_from_process_start", "ttft_from_process_start")} | {"log": r.get("log", [])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("-O", dest="level", type=int, default=1)
    parser.add_argument("--threads", "--num-threads", dest="threads", type=int, default=default_threads())
    parser.add_argument("--dtype", default="auto", help="auto: float32, plus bfloat16 where the CPU has native bf16")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    parser.add_argument("--quick", action="store_true", help="one run")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    vllm_missing = "skipped (--no-vllm)" if args.no_vllm else peer_vllm.missing_reason()
    model = args.model
    if model is None and not vllm_missing:
        from compiled_llm.bundled_model import bundled_model_path

        model = str(bundled_model_path())
    if vllm_missing:
        print(f"vLLM-CPU: {vllm_missing}")
    print(f"{args.threads} threads; medians of {runs} runs; each start a fresh process", flush=True)

    everything = {}
    for dtype in dtypes_to_run(args.dtype):
        rows: dict[str, list[dict]] = {"ours cold": [], "ours warm": [], "vLLM cold": [], "vLLM warm": []}
        for i in range(runs):
            with tempfile.TemporaryDirectory(prefix="startup-cache-") as cache:
                rows["ours cold"].append(run_probe(model, args.level, cache, args.threads, dtype))
                rows["ours warm"].append(run_probe(model, args.level, cache, args.threads, dtype))
            print(f"[{dtype}] run {i + 1}: ours cold {json.dumps(rows['ours cold'][-1])}\n"
                  f"{'':>{len(dtype) + 9}}ours warm {json.dumps(rows['ours warm'][-1])}", flush=True)
            if vllm_missing:
                continue
            with tempfile.TemporaryDirectory(prefix="startup-vllm-cache-") as cache:
                for kind in ("cold", "warm"):
                    try:
                        r = run_vllm(model, cache, args.threads, dtype)
                    except RuntimeError as e:
                        print(f"[{dtype}] vLLM {kind} start failed: {e}")
                        continue
                    rows[f"vLLM {kind}"].append(r)
                    print(f"{'':>{len(dtype) + 9}}vLLM {kind} ready {r['ready_from_process_start']:.2f} s, "
                          f"first token {r['ttft_from_process_start']:.2f} s; " + "; ".join(r["log"][-3:]), flush=True)

        def med(name, key, rows=rows):
            values = [r[key] for r in rows[name] if key in r]
            return statistics.median(values) if values else None

        def cell(v, fmt="{:.2f}"):
            return fmt.format(v) if v is not None else "-"

        print(f"\n{dtype}, -O{args.level}, {args.threads} threads (seconds from process start; medians of {runs})")
        print(f"{'start':<6} {'ours ready':>11} {'vLLM ready':>11} {'ours/vLLM':>10} {'ours 1st tok':>13} "
              f"{'vLLM 1st tok':>13} {'ours/vLLM':>10} {'ours compile':>13} {'ours Inductor comps':>20}")
        for kind in ("cold", "warm"):
            o, v = f"ours {kind}", f"vLLM {kind}"
            ours_ready, vllm_ready = cell(med(o, "ready_from_process_start")), cell(med(v, "ready_from_process_start"))
            print(f"{kind:<6} {ours_ready:>11} {vllm_ready:>11} "
                  f"{ratio(med(o, 'ready_from_process_start'), med(v, 'ready_from_process_start')):>10} "
                  f"{cell(med(o, 'ttft_from_process_start')):>13} {cell(med(v, 'ttft_from_process_start')):>13} "
                  f"{ratio(med(o, 'ttft_from_process_start'), med(v, 'ttft_from_process_start')):>10} "
                  f"{cell(med(o, 'compile_phase')):>13} {cell(med(o, 'inductor_compilations'), '{:.0f}'):>20}")
        ours = ratio(med("ours cold", "ttft_from_process_start"), med("ours warm", "ttft_from_process_start"))
        vllm = ratio(med("vLLM cold", "ttft_from_process_start"), med("vLLM warm", "ttft_from_process_start"))
        print(f"{'cold/warm':<6} {ours:>7} (ours, first token) {vllm:>7} (vLLM)")
        if vllm_missing:
            print(f"vLLM-CPU: {vllm_missing}")
        print(flush=True)
        everything[dtype] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=2)


if __name__ == "__main__":
    main()
