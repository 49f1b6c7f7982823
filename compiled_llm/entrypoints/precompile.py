"""`compiled-llm precompile`: fill the compile cache that `serve` (with the same flags) reads.

Meant for CI and image builds: it loads the model, traces it and compiles (or loads) every
piece for every compile range and size, then exits. `--print-cache-key` prints the cache
entry's key without compiling, so CI systems can key their stored caches on it.
"""

from __future__ import annotations

import argparse
import json
import time

from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.logger import init_logger

logger = init_logger(__name__)


def add_precompile_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("precompile")
    g.add_argument("--json", action="store_true", help="End with one line of JSON describing what was done.")
    g.add_argument("--print-cache-key", action="store_true",
                   help="Print the compile cache key for these settings and exit without compiling.")


def run_precompile(args: argparse.Namespace) -> int:
    from compiled_llm.compilation.cache_key import engine_compile_cache
    from compiled_llm.executor import make_executor

    config = EngineArgs.from_cli_args(args).create_engine_config()
    if config.compilation_config.level == 0:
        raise SystemExit("precompile needs an optimization level of 1 or more (-O1, -O2): -O0 compiles nothing.")
    if args.print_cache_key:
        print(engine_compile_cache(config).key)
        return 0
    started = time.perf_counter()
    # Every tensor-parallel rank compiles (or loads) its own slice into its own entry.
    executor = make_executor(config)
    try:
        # Compiled pieces do not depend on the KV cache's size: a minimal one is enough to trace.
        executor.initialize_kv_cache(num_blocks=2)
        ranks = executor.compile()  # CUDA graphs are not saved (they hold device addresses): `serve` captures them
    finally:
        executor.shutdown()
    compiled = executor.driver.compiled_forward  # rank 0's report; the others did the same work
    report = compiled.report
    result = {
        "pieces": report.pieces,
        "unique_pieces": report.unique_pieces,
        "compile_ranges": [list(r) for r in report.compile_ranges],
        "compile_sizes": report.compile_sizes,
        "inductor_compilations": report.inductor_compilations,
        "artifacts_saved": report.artifacts_saved,
        "artifacts_loaded": report.artifacts_loaded,
        "seconds": round(compiled.seconds or 0.0, 3),
        "cache_dir": report.cache_dir,
        "ranks": ranks,  # each tensor-parallel rank's compilations and loads (one rank without TP)
        "total_seconds": round(time.perf_counter() - started, 3),
    }
    logger.info("Precompile done: %d Inductor compilations, %d artifacts loaded, %.2f s; cache %s",
                result["inductor_compilations"], result["artifacts_loaded"], result["seconds"], result["cache_dir"])
    if args.json:
        print(json.dumps(result), flush=True)
    return 0
