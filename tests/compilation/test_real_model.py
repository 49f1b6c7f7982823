"""Compilation on the real SmolLM2-135M: -O1 equals -O0, and precompile's warm start."""

from __future__ import annotations

import json
import subprocess

from compiled_llm import LLM, SamplingParams
from tests.models.test_hf_parity import PROMPTS
from tests.oracle import check_close, ours_greedy


def test_o1_greedy_output_matches_o0(real_model_path, warm_compile_cache):
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5, ignore_eos=True)
    compiled = LLM(real_model_path, optimization_level=1, require_cache_hit=True, max_model_len=1024,
                   kv_cache_memory_bytes=128 << 20)
    runner = compiled.llm_engine.engine_core.executor.driver
    assert runner.compiled_forward.report.inductor_compilations == 0  # a warm start
    ours = compiled.generate(PROMPTS, params, use_tqdm=False)
    del compiled
    eager = LLM(real_model_path, optimization_level=0, max_model_len=1024, kv_cache_memory_bytes=128 << 20)
    reference = eager.generate(PROMPTS, params, use_tqdm=False)
    exact = check_close(ours_greedy(ours), ours_greedy(reference), "-O1", "-O0")
    assert exact >= len(PROMPTS) - 2


def _precompile(cache, *extra):
    out = subprocess.run(["compiled-llm", "precompile", "--compile-cache", str(cache), "--json", *extra],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_precompile_warm_start_loads_everything_fast(precompiled_default):
    cache, cold = precompiled_default  # a cold precompile into a fresh folder
    assert cold["inductor_compilations"] == cold["unique_pieces"] * len(cold["compile_ranges"]) > 0
    assert cold["pieces"] == 31 and cold["unique_pieces"] == 3  # 30 layers around 30 attention calls
    warm = _precompile(cache, "--require-cache-hit")
    assert warm["inductor_compilations"] == 0
    assert warm["artifacts_loaded"] == cold["artifacts_saved"]
    assert warm["cache_dir"] == cold["cache_dir"]
    assert warm["seconds"] <= cold["seconds"] / 4, (warm["seconds"], cold["seconds"])
    key = subprocess.run(["compiled-llm", "precompile", "--compile-cache", str(cache), "--print-cache-key"],
                         capture_output=True, text=True, timeout=300).stdout.strip()
    assert cold["cache_dir"].endswith(key)


def test_strict_start_on_an_empty_cache_names_the_folder(tmp_path):
    out = subprocess.run(["compiled-llm", "precompile", "--compile-cache", str(tmp_path), "--require-cache-hit"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "error: Compile cache miss in" in out.stderr and str(tmp_path) in out.stderr
    assert "Traceback" not in out.stderr
