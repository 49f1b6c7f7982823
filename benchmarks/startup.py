"""Cold start vs warm start: time to first token from process start, and the compile phase alone.

Each run is a fresh Python process building the engine at -O1 (or -O given) with a compile cache
folder: empty for a cold start, the one the cold start filled for a warm start.

    python benchmarks/startup.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PROBE = r"""
import json, sys, time, psutil
started = psutil.Process().create_time()
from compiled_llm import LLM, SamplingParams
llm = LLM(sys.argv[1] if sys.argv[1] != "-" else None, optimization_level=int(sys.argv[2]), compile_cache=sys.argv[3],
          max_model_len=2048, num_threads=int(sys.argv[4]))
ready = time.time()
llm.generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)
first_token = time.time()
runner = llm.llm_engine.engine_core.runner
compiled = getattr(runner, "compiled_forward", None)
print(json.dumps({
    "ttft_from_process_start": first_token - started,
    "ready_from_process_start": ready - started,
    "compile_phase": compiled.seconds if compiled else 0.0,
    "inductor_compilations": compiled.report.inductor_compilations if compiled else 0,
    "artifacts_loaded": compiled.report.artifacts_loaded if compiled else 0,
}))
"""


def run_probe(model: str | None, level: int, cache: str, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, model or "-", str(level), cache, str(threads)],
                         capture_output=True, text=True, check=True, env={**os.environ, "COMPILED_LLM_LOG_LEVEL": "WARNING"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("-O", dest="level", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    cold, warm = [], []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="startup-cache-") as cache:
            cold.append(run_probe(args.model, args.level, cache, args.threads))
            warm.append(run_probe(args.model, args.level, cache, args.threads))
            print(f"run {i + 1}: cold {json.dumps(cold[-1])}\n       warm {json.dumps(warm[-1])}", flush=True)

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    print(f"\n{'-O' + str(args.level):<6} {'TTFT from process start (s)':>28} {'compile phase (s)':>18} {'Inductor compilations':>22}")
    for name, rows in (("cold", cold), ("warm", warm)):
        print(f"{name:<6} {med(rows, 'ttft_from_process_start'):>28.2f} {med(rows, 'compile_phase'):>18.2f} "
              f"{med(rows, 'inductor_compilations'):>22.0f}")
    print(f"{'ratio':<6} {med(cold, 'ttft_from_process_start') / med(warm, 'ttft_from_process_start'):>27.1f}x "
          f"{med(cold, 'compile_phase') / med(warm, 'compile_phase'):>17.1f}x")


if __name__ == "__main__":
    main()
