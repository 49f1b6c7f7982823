"""Compile the toy model in this process (or a fresh one via `main`) and report what happened."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from compiled_llm.compilation.cache_key import cache_key, compute_factors, model_sources, package_sources
from compiled_llm.compilation.compile_cache import CompileCache, read_signing_key
from compiled_llm.compilation.compiled_forward import CompiledForward
from compiled_llm.compilation.config import CompilationConfig
from compiled_llm.compilation.counters import counters
from tests.compilation.toy_model import SPLITTING_OPS, ToyModel, inputs

MAX_TOKENS = 32
CHECK_SIZES = (1, 2, 4, 5, 16, 17, 32)


def toy_config(cache_dir: str, ranges=None, sizes=(), strict: bool = False,
               signing_key_file: str | None = None) -> CompilationConfig:
    return CompilationConfig.resolve(
        "cpu", max_num_seqs=8, max_num_batched_tokens=MAX_TOKENS, level=1, cache_dir=cache_dir, compile_ranges=ranges,
        compile_sizes=sizes, splitting_ops=SPLITTING_OPS, require_cache_hit=strict,
        cache_signing_key_file=signing_key_file,
    )


def toy_factors(config: CompilationConfig, model: torch.nn.Module, dtype=torch.float32, max_tokens=MAX_TOKENS,
                extra_sources: list[Path] = ()):
    return compute_factors(hf_config={"toy": len(model.layers)}, dtype=dtype, device=torch.device("cpu"),
                           compilation_config=config, max_num_batched_tokens=max_tokens,
                           source_files=package_sources() + model_sources(model) + list(extra_sources))


def compile_toy(cache_dir: str, ranges=None, sizes=(), strict: bool = False, signing_key_file: str | None = None,
                key: str | None = None):
    """Returns (model, compiled forward, counters snapshot). `key`: use this cache key instead of
    computing it (the source hash changes whenever a package file is edited)."""
    model = ToyModel().eval()
    config = toy_config(cache_dir, ranges, sizes, strict, signing_key_file)
    factors = toy_factors(config, model)
    signing_key = read_signing_key(signing_key_file) if signing_key_file else None
    cache = CompileCache(cache_dir, key or cache_key(factors), factors, signing_key)
    compiled = CompiledForward(model, config, cache, MAX_TOKENS, progress=False)
    with torch.inference_mode():
        compiled.trace(*inputs(8))
    return model, compiled, dict(vars(counters))


def max_error(model, compiled, sizes=CHECK_SIZES) -> float:
    err = 0.0
    with torch.inference_mode():
        for n in sizes:
            x, pos = inputs(n)
            err = max(err, (compiled(x, pos) - model(x, pos)).abs().max().item())
    return err


def main() -> None:
    cache_dir, ranges, sizes, strict = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "1"
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}  # signing_key_file, key
    try:
        ranges = [tuple(r) for r in ranges] if ranges else None
        model, compiled, snapshot = compile_toy(cache_dir, ranges, sizes, strict, **options)
    except Exception as e:  # reported to the parent test as data
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    snapshot["max_error"] = max_error(model, compiled)
    snapshot["cache_entry"] = compiled.report.cache_dir
    print(json.dumps(snapshot))


if __name__ == "__main__":
    main()
