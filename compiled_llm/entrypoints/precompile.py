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
    g.add_argument("--explain", action="store_true",
                   help="Say whether these settings hit the compile cache and, on a miss, which factors differ "
                        "from the nearest entries; exit without compiling.")


# What `--json` reports of each tensor-parallel rank.
RANK_FIELDS = ("rank", "inductor_compilations", "artifacts_loaded", "cache_dir")


def run_precompile(args: argparse.Namespace) -> int:
    from compiled_llm.compilation.cache_key import cache_key
    from compiled_llm.executor import make_executor
    from compiled_llm.worker.cache_factors import engine_cache_factors

    config = EngineArgs.from_cli_args(args).create_engine_config()
    if config.compilation_config.level == 0:
        raise SystemExit("precompile needs an optimization level of 1 or more (-O1, -O2): -O0 compiles nothing.")
    if args.print_cache_key:
        print(cache_key(engine_cache_factors(config, rank=0)))
        return 0
    if args.explain:
        from compiled_llm.entrypoints.cache_cli import explain_lines

        print("\n".join(explain_lines(config)))
        return 0
    started = time.perf_counter()
    # Every tensor-parallel rank compiles (or loads) its own slice into its own entry.
    executor = make_executor(config)
    try:
        # Compiled pieces do not depend on the KV cache's size: a minimal one is enough to trace.
        executor.collective_rpc("initialize_kv_cache", 2)
        # CUDA graphs are not saved (they hold device addresses): `serve` captures them.
        ranks = executor.collective_rpc("compile")
    finally:
        executor.shutdown()
    driver = ranks[0]  # rank 0's summary; the others did the same work on their slices
    result = {
        "pieces": driver["pieces"],
        "unique_pieces": driver["unique_pieces"],
        "compile_ranges": [list(r) for r in driver["compile_ranges"]],
        "compile_sizes": driver["compile_sizes"],
        "inductor_compilations": driver["inductor_compilations"],
        "artifacts_saved": driver["artifacts_saved"],
        "artifacts_loaded": driver["artifacts_loaded"],
        "seconds": round(driver["seconds"] or 0.0, 3),
        "cache_dir": driver["cache_dir"],
        # Each tensor-parallel rank's compilations and loads (one rank without TP).
        "ranks": [{field: rank[field] for field in RANK_FIELDS} for rank in ranks],
        "total_seconds": round(time.perf_counter() - started, 3),
    }
    logger.info("Precompile done: %d Inductor compilations, %d artifacts loaded, %.2f s; cache %s",
                result["inductor_compilations"], result["artifacts_loaded"], result["seconds"], result["cache_dir"])
    if args.json:
        print(json.dumps(result), flush=True)
    return 0
