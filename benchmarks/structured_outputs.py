"""The cost of a JSON-schema constraint per decode step, against unconstrained decoding.

Batches of 1 and 32 requests on the bundled model decode with every request constrained by a
JSON schema, with half of them constrained (mixed), and with none. The schema (an array of at
least 64 objects with a bounded name, an integer age and an enum city) cannot be complete within
the timed steps, so every request decodes the same number of steps in every mode. Per mode: the
median time of an engine step after prefill and warm-up, the decode throughput it gives, its
ratio to unconstrained decoding (the aim: constrained within 10%), and the host time the grammar
adds to a step (filling the bitmask in the engine core, applying it to the logits in the runner),
measured around those two calls, and its share of the unconstrained step. Medians of --runs runs,
the modes interleaved. On a shared, loaded machine the step-time ratio moves by several percent
between runs; the grammar's own share is the steadier figure.

    python benchmarks/structured_outputs.py [--batches 1,32] [--steps 32] [--runs 3] [-O 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import numpy as np

CITIES = ["Paris", "London", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Prague"]
SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": CITIES},
        },
        "required": ["name", "age", "city"],
    },
}
PROMPT_TOKENS = 64
WARMUP_STEPS = 3


class GrammarTimer:
    """Host seconds spent in the grammar's two calls per step: fill (core) and apply (runner)."""

    def __init__(self) -> None:
        self.fill = 0.0
        self.apply = 0.0

    @contextmanager
    def installed(self, core):
        import compiled_llm.worker.model_runner as model_runner
        from compiled_llm.core.structured_outputs.manager import StructuredOutputManager

        fill, apply = StructuredOutputManager.grammar_bitmask, model_runner.apply_grammar_bitmask

        def timed_fill(manager, requests):
            start = time.perf_counter()
            try:
                return fill(manager, requests)
            finally:
                self.fill += time.perf_counter() - start

        def timed_apply(logits, bitmask, rows):
            start = time.perf_counter()
            try:
                return apply(logits, bitmask, rows)
            finally:
                self.apply += time.perf_counter() - start

        StructuredOutputManager.grammar_bitmask, model_runner.apply_grammar_bitmask = timed_fill, timed_apply
        try:
            yield self
        finally:
            StructuredOutputManager.grammar_bitmask, model_runner.apply_grammar_bitmask = fill, apply


def run_once(llm, batch: int, constrained: list[bool], steps: int, tag: str) -> dict:
    """Time `steps` decode steps of `batch` requests; returns the median step and grammar times."""
    from compiled_llm import SamplingParams
    from compiled_llm.sampling_params import StructuredOutputsParams

    engine = llm.llm_engine
    core = engine.engine_core
    rng = np.random.default_rng(0)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid, constrain in zip(ids, constrained):
        params = SamplingParams(temperature=0.0, max_tokens=steps + WARMUP_STEPS + 8, ignore_eos=True,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrain else None)
        engine.add_request(rid, {"prompt_token_ids": rng.integers(100, 40000, PROMPT_TOKENS).tolist()}, params)
    while core.scheduler.waiting or len(core.structured_outputs or []):  # grammar ready and prompts prefilled
        core.step()
    for _ in range(WARMUP_STEPS):
        core.step()
    timer = GrammarTimer()
    step_times = []
    with timer.installed(core):
        for _ in range(steps):
            start = time.perf_counter()
            core.step()
            step_times.append(time.perf_counter() - start)
    assert len(core.scheduler.running) == batch, "a request finished early: the timed steps would be uneven"
    engine.abort_request(ids)
    return {
        "step_ms": statistics.median(step_times) * 1e3,
        "grammar_fill_ms": timer.fill / steps * 1e3,
        "grammar_apply_ms": timer.apply / steps * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure, medians reported")
    parser.add_argument("-O", "--optimization-level", dest="level", type=int, default=None)
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args()

    from compiled_llm import LLM
    from compiled_llm.sampling_params import StructuredOutputsParams
    from compiled_llm.structured_output_spec import grammar_spec

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, optimization_level=args.level, compile_cache=args.compile_cache,
              max_num_seqs=max(max(batches), 8))
    results: dict = {"steps": args.steps, "runs": args.runs, "level": llm.llm_engine.config.compilation_config.level}
    for batch in batches:
        modes = {"unconstrained": [False] * batch, "constrained": [True] * batch}
        if batch > 1:
            modes["mixed"] = [i % 2 == 0 for i in range(batch)]
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for r in range(args.runs):  # modes interleaved: the machine's load drifts alike for all
            for mode, constrained in modes.items():
                runs[mode].append(run_once(llm, batch, constrained, args.steps, f"b{batch}-{mode}-{r}"))
        figures = {mode: {key: statistics.median(run[key] for run in mode_runs) for key in mode_runs[0]}
                   for mode, mode_runs in runs.items()}
        base = figures["unconstrained"]
        for fig in figures.values():
            fig["tokens_per_s"] = batch / fig["step_ms"] * 1e3
            fig["throughput_vs_unconstrained"] = base["step_ms"] / fig["step_ms"]
            # The grammar's own host time against the unconstrained step: the steadier figure.
            fig["grammar_share"] = (fig["grammar_fill_ms"] + fig["grammar_apply_ms"]) / base["step_ms"]
        results[f"batch_{batch}"] = figures
    # One compilation of a schema of this size (a variant the cache has not seen).
    start = time.perf_counter()
    spec = grammar_spec(StructuredOutputsParams(json=dict(SCHEMA, minItems=65)))
    llm.llm_engine.engine_core.structured_outputs.compilers.compile(spec).result()
    results["schema_compile_ms"] = (time.perf_counter() - start) * 1e3

    print(f"JSON-schema constraint per decode step (-O{results['level']}, {args.steps} steps, medians of {args.runs} "
          "runs; a shared machine: noisy)")
    print(f"{'batch':>5} {'mode':>13} {'step ms':>9} {'tok/s':>8} {'vs unconstr.':>12} {'fill ms':>8} "
          f"{'apply ms':>9} {'grammar share':>13}")
    for batch in batches:
        for mode, fig in results[f"batch_{batch}"].items():
            print(f"{batch:>5} {mode:>13} {fig['step_ms']:>9.2f} {fig['tokens_per_s']:>8.1f} "
                  f"{fig['throughput_vs_unconstrained']:>12.3f} {fig['grammar_fill_ms']:>8.3f} "
                  f"{fig['grammar_apply_ms']:>9.3f} {fig['grammar_share']:>12.1%}")
    print(f"schema compilation: {results['schema_compile_ms']:.1f} ms (once per distinct schema)")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
