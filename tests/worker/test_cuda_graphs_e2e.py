"""End to end on a GPU: -O2 (compiled pieces + FULL_AND_PIECEWISE CUDA graphs) against eager, on a
model of SmolLM2-135M's shape in bf16 with random weights (the checkpoint is not needed)."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.compilation.counters import counters
from compiled_llm.models.dummy import write_dummy_model
from tests.oracle import check_close, ours_greedy

pytestmark = pytest.mark.cuda

PROMPTS = [[(7 * i + j) % 40000 + 3 for j in range(n)] for i, n in enumerate([5, 17, 64, 128, 3, 200, 31, 90])]


def make_llm(folder: str, level: int, cache: str) -> LLM:
    return LLM(folder, load_format="dummy", dtype="bfloat16", optimization_level=level, compile_cache=cache,
               max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512, kv_cache_memory_bytes=1 << 30)


def test_o2_greedy_generation_matches_eager(tmp_path):
    folder = write_dummy_model(tmp_path / "smollm2-shape")
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    eager = make_llm(folder, 0, str(tmp_path / "cache"))
    reference = eager.generate(prompts, params, use_tqdm=False)
    del eager

    captured_before = counters.num_cudagraph_captured
    graphs = make_llm(folder, 2, str(tmp_path / "cache"))
    runner = graphs.llm_engine.engine_core.executor.driver
    assert runner.dispatcher is not None
    captured = counters.num_cudagraph_captured - captured_before
    assert captured > 0
    replayed = counters.num_cudagraph_replayed
    ours = graphs.generate(prompts, params, use_tqdm=False)
    assert counters.num_cudagraph_captured - captured_before == captured, "a graph was captured while serving"
    assert counters.num_cudagraph_replayed > replayed
    check_close(ours_greedy(ours), ours_greedy(reference), "-O2", "eager")
    # Single requests decode through FULL graphs (uniform batches of one).
    single = graphs.generate(prompts[:1], params, use_tqdm=False)
    check_close(ours_greedy(single), ours_greedy(reference[:1]), "-O2 single", "eager")
