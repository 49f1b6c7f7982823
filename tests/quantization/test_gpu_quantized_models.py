"""End to end on a GPU, per weight format: -O2 (compiled pieces around the quantized ops, captured
in CUDA graphs) gives eager's tokens (or each side's in the other's top 5), on a model of SmolLM2's
shape with random weights (no checkpoint needed). The layers take the GPU paths: int4 the Triton
GEMM (kernels/triton_quant_gemm.py), fp8 `torch._scaled_mm` on compute capability >= 8.9."""

from __future__ import annotations

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.compilation.counters import counters
from compiled_llm.models.dummy import write_dummy_model
from tests.oracle import check_close, ours_greedy

pytestmark = pytest.mark.cuda

PROMPTS = [[(7 * i + j) % 40000 + 3 for j in range(n)] for i, n in enumerate([5, 17, 64, 3, 90])]


def make_llm(folder: str, quantization: str, level: int, cache: str) -> LLM:
    return LLM(folder, load_format="dummy", dtype="bfloat16", quantization=quantization, optimization_level=level,
               compile_cache=cache, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
               cudagraph_capture_sizes=[1, 2, 4, 8, 64, 256], kv_cache_memory_bytes=1 << 30)


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_o2_quantized_generation_matches_eager(tmp_path, quantization):
    folder = write_dummy_model(tmp_path / "smollm2-shape")
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    eager = make_llm(folder, quantization, 0, str(tmp_path / "cache"))
    layer = eager.llm_engine.engine_core.executor.driver.model.model.layers[0].mlp.gate_up_proj
    if quantization == "int4":
        assert layer.triton_kernel and layer.qweight.dtype == torch.uint8  # packed two a byte
    else:
        from compiled_llm.kernels.fp8_linear import scaled_mm_supported

        assert layer.weight.dtype == torch.float8_e4m3fn
        assert layer.fp8_scaled_mm == scaled_mm_supported(layer.weight.device)
    reference = eager.generate(prompts, params, use_tqdm=False)
    eager.llm_engine.engine_core.shutdown()
    del eager, layer

    captured_before = counters.num_cudagraph_captured
    graphs = make_llm(folder, quantization, 2, str(tmp_path / "cache"))
    assert counters.num_cudagraph_captured > captured_before
    replayed = counters.num_cudagraph_replayed
    try:
        ours = graphs.generate(prompts, params, use_tqdm=False)
        assert counters.num_cudagraph_replayed > replayed
    finally:
        graphs.llm_engine.engine_core.shutdown()
    check_close(ours_greedy(ours), ours_greedy(reference), f"{quantization} -O2", "eager")
