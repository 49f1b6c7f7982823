"""Tensor parallelism on the CPU (gloo): two ranks give the tokens one rank gives, on the bundled
model (whose 9 query heads in 3 key-value groups split unevenly) and on the tiny Llama, Qwen2 and
Qwen3 models; prefix caching and preemption stay correct; each rank compiles its own slice into
its own cache entry, and a strict warm start loads them all."""

from __future__ import annotations

import json
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compiled_llm import LLM, SamplingParams
from compiled_llm.models.layers.parallel import HeadPartition, split_sizes

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "1, 2, 3, 4, 5,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def generate(model: str, tp: int, prompts=PROMPTS, params=GREEDY, preempts: bool = False, **engine) -> list[list[int]]:
    engine = {"optimization_level": 0, "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20, **engine}
    llm = LLM(model, tensor_parallel_size=tp, **engine)
    try:
        core = llm.llm_engine.engine_core
        outs = llm.generate(prompts, params, use_tqdm=False)
        pool = core.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks - 1
        assert (core.scheduler.num_preemptions > 0) == preempts
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()


# ---- how heads and rows are split ---------------------------------------------------------------
@given(total=st.integers(1, 100), parts=st.integers(1, 9))
def test_split_sizes_cover_the_whole_evenly(total, parts):
    sizes = split_sizes(total, parts)
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(num_kv=st.integers(1, 8), group=st.integers(1, 4), world=st.integers(1, 8))
def test_head_partitions_keep_every_query_head_with_its_key_value_head(num_kv, group, world):
    num_heads = num_kv * group
    try:
        parts = [HeadPartition.for_rank(num_heads, num_kv, r, world) for r in range(world)]
    except ValueError as e:
        assert num_kv < world and (world % num_kv or num_heads % world), e
        return
    owned = sorted(h for p in parts for h in p.q_heads)
    assert owned == list(range(num_heads))  # every query head on exactly one rank
    for p in parts:
        assert len(p.q_heads) > 0 and len(p.kv_heads) > 0
        assert all(h // group in p.kv_heads for h in p.q_heads)  # its key-value head is on the rank too


def test_smollm2_heads_split_unevenly_over_two_ranks():
    assert [HeadPartition.for_rank(9, 3, r, 2) for r in range(2)] == [
        HeadPartition(range(0, 6), range(0, 2)), HeadPartition(range(6, 9), range(2, 3))]


# ---- the same tokens --------------------------------------------------------------------------
def test_bundled_model_tp2_equals_tp1(real_model_path):
    assert generate(real_model_path, 2) == generate(real_model_path, 1)


@pytest.mark.parametrize("arch", ["llama-biased", "qwen2-tied", "qwen3-biased"])
def test_tiny_models_tp2_equal_tp1(tiny_model_factory, arch):
    model = tiny_model_factory(arch)
    assert generate(model, 2) == generate(model, 1)


def test_prefix_caching_and_preemption_under_tp2(tiny_llama):
    shared = "A shared beginning that every prompt repeats word for word, " * 4
    prompts = [shared + f"then request {i} goes its own way" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # A KV cache that holds about two of the six at once: requests are preempted and recomputed.
    tight = dict(kv_cache_memory_bytes=88 << 10, max_model_len=256, max_num_seqs=6)
    expected = generate(tiny_llama, 1, prompts, params, kv_cache_memory_bytes=64 << 20)
    assert generate(tiny_llama, 2, prompts, params, preempts=True, **tight) == expected
    assert generate(tiny_llama, 2, prompts, params, preempts=True, async_scheduling=True, **tight) == expected


# ---- compiled, and cached per rank ------------------------------------------------------------
def _precompile(model: str, cache, *extra) -> dict:
    out = subprocess.run(["compiled-llm", "precompile", model, "--compile-cache", str(cache), "-tp", "2", "--json",
                          "--max-model-len", "512", *extra], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_precompile_then_strict_warm_start_at_tp2(tiny_llama, tmp_path):
    cold = _precompile(tiny_llama, tmp_path)
    assert [r["rank"] for r in cold["ranks"]] == [0, 1]
    assert all(r["inductor_compilations"] > 0 for r in cold["ranks"])
    assert len({r["cache_dir"] for r in cold["ranks"]}) == 2  # an entry per rank
    warm = _precompile(tiny_llama, tmp_path, "--require-cache-hit")
    assert all(r["inductor_compilations"] == 0 and r["artifacts_loaded"] > 0 for r in warm["ranks"])
    # Served from those entries, compiled: the tokens of the eager single-rank engine.
    compiled = generate(tiny_llama, 2, optimization_level=1, compile_cache=str(tmp_path), require_cache_hit=True)
    assert compiled == generate(tiny_llama, 1)
