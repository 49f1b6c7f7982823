"""16-bit weight storage: float32 activations over bf16 or fp16 linear weights. This machine may
have native bf16, so the method is asked for by name here; config tests cover the automatic choice
(tests/quantization/test_quantization_config.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiled_llm import LLM, SamplingParams
from compiled_llm.kernels.cpu_extension import cpu_kernels_available
from compiled_llm.models.layers.linear import MergedLinear
from compiled_llm.quantization.fp16_storage import HalfStorageConfig
from tests.models.test_hf_parity import PROMPTS
from tests.oracle import check_close, ours_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_layer_keeps_only_the_packed_16_bit_weight(dtype):
    g = torch.Generator().manual_seed(0)
    layer = MergedLinear(64, [24, 40], bias=True, cpu_kernel=True,
                         quant_config=HalfStorageConfig({"dtype": dtype}), prefix="mlp.gate_up_proj")
    assert layer.weight.dtype == getattr(torch, dtype)
    parts = [torch.randn(24, 64, generator=g), torch.randn(40, 64, generator=g)]
    for i, part in enumerate(parts):
        layer.load_checkpoint("weight", part, i)
    layer.bias.data.normal_(generator=g)
    stored = layer.weight.detach().float().clone()
    layer.process_weights_after_loading()
    if cpu_kernels_available():
        assert layer.packed_weight is not None and not hasattr(layer, "weight")
    x = torch.randn(7, 64, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, stored, layer.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stored, torch.cat(parts).to(getattr(torch, dtype)).float())


@pytest.fixture(scope="module")
def bundled_float(real_model_path):
    return _greedy(real_model_path, "float32", None)


def _greedy(model: str, dtype: str, quantization: str | None):
    llm = LLM(model, dtype=dtype, quantization=quantization, optimization_level=0, max_model_len=512,
              kv_cache_memory_bytes=64 << 20)
    try:
        return ours_greedy(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bundled_model_stays_close_to_float32(real_model_path, bundled_float, dtype):
    exact = check_close(_greedy(real_model_path, dtype, "fp16_storage"), bundled_float, dtype, "float32")
    assert exact >= len(PROMPTS) // 2


def test_tiny_random_model_stays_close_to_float32(tiny_model_factory):
    model = tiny_model_factory("qwen2-tied")
    check_close(_greedy(model, "bfloat16", "fp16_storage"), _greedy(model, "float32", None), "bf16 storage", "fp32")
