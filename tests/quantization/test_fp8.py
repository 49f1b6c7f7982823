"""`--quantization fp8`: e4m3 weights with per-channel scales, quantized at load. The round trip's
bounds, both forwards against float references (torch 2.13 runs `torch._scaled_mm` with float8 on a
CPU, so the per-token scaled path is checked here too, through Inductor as well), a tiny random
model within float32's top 5 through the LLM API, and a strict warm start that compiles nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from compiled_llm.kernels.fp8_linear import FP8, FP8_MAX, dequantize_fp8_rows, quantize_fp8_rows
from compiled_llm.models.layers.linear import Linear, MergedLinear
from compiled_llm.quantization import get_quantization_config
from compiled_llm.quantization.fp8 import Fp8LinearMethod
from tests.models.test_hf_parity import PROMPTS
from tests.oracle import check_close
from tests.quantization.greedy import greedy

E4M3_EPS = 2.0**-4  # e4m3's unit roundoff (3 mantissa bits), for normal values
E4M3_SUBNORMAL = 2.0**-9  # the spacing of its subnormals (and its smallest positive value)


# ---- the round trip -------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows=st.integers(1, 9), cols=st.integers(1, 300), log_scale=st.integers(-30, 12),
       zero_row=st.booleans(), seed=st.integers(0, 2**16))
def test_round_trip_is_within_e4m3_rounding(rows, cols, log_scale, zero_row, seed):
    """Each element comes back within half a step of e4m3 at its scale: 2^-4 relative for normal
    values, half the subnormal spacing times the row's scale below them; each row's largest
    magnitude is exactly +-448 in fp8; an all-zero row stays zeros (no division by zero)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 2.0**log_scale
    if zero_row:
        w[0] = 0
    q, scale = quantize_fp8_rows(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (rows, 1)
    back = dequantize_fp8_rows(q, scale)
    assert torch.isfinite(back).all()
    bound = torch.maximum(E4M3_EPS * w.abs(), E4M3_SUBNORMAL / 2 * scale) * (1 + 1e-6)
    assert torch.all((back - w).abs() <= bound)
    peaks = q.float().abs().amax(dim=1)
    nonzero = w.abs().amax(dim=1) > 0
    assert torch.all(peaks[nonzero] == FP8_MAX)
    if zero_row:
        assert torch.equal(back[0], torch.zeros(cols))


# ---- one layer --------------------------------------------------------------------------------------
def _fp8_layer(scaled_mm: bool | None, in_features: int = 256, sizes=(48, 80), bias: bool = True,
               dtype: torch.dtype = torch.float32, seed: int = 0):
    """A fused layer under fp8 (its parts quantized as they load) and the float parts it loaded."""

    class Config:
        def linear_method(self, prefix):
            return Fp8LinearMethod(scaled_mm)

    g = torch.Generator().manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = MergedLinear(in_features, list(sizes), bias=bias, quant_config=Config(), prefix="mlp")
    finally:
        torch.set_default_dtype(prev)
    parts = [torch.randn(n, in_features, generator=g, device="cpu") * 0.05 for n in sizes]
    for i, part in enumerate(parts):
        layer.load_checkpoint("weight", part, i)
        if bias:
            layer.load_checkpoint("bias", torch.randn(part.shape[0], generator=g, device="cpu") * 0.1, i)
    layer.process_weights_after_loading()
    return layer, torch.cat(parts)


def test_weight_only_forward_equals_float_on_the_fp8_weights():
    """1 byte a weight, no float copy kept; the forward is x W^T + b with W the fp8 weights times
    their channel scales, to float32 rounding, and within e4m3's rounding of the float weights."""
    layer, w = _fp8_layer(scaled_mm=False)
    assert layer.weight.dtype == FP8 and layer.weight.shape == (128, 256) and not layer.fp8_scaled_mm
    assert not any(p.dtype.is_floating_point and p.dtype != FP8 and p.numel() == w.numel()
                   for p in [*layer.parameters(), *layer.buffers()])
    x = torch.randn(7, 256)
    fp8_weight = torch.cat([dequantize_fp8_rows(*quantize_fp8_rows(p)) for p in w.split([48, 80])])
    torch.testing.assert_close(layer(x), F.linear(x, fp8_weight, layer.bias), rtol=1e-5, atol=1e-5)
    magnitude = x.abs() @ w.abs().T
    assert torch.all((layer(x) - F.linear(x, w, layer.bias)).abs() <= E4M3_EPS * magnitude + 1e-6)


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_scaled_mm_forward_quantizes_each_token(rows):
    """The per-token path (torch._scaled_mm, run by torch on this CPU): equal, to the bfloat16 output's
    rounding, to float math on the fp8 activations and fp8 weights; within e4m3's rounding of both
    operands of the float product."""
    layer, w = _fp8_layer(scaled_mm=True)
    assert layer.fp8_scaled_mm
    x = torch.randn(rows, 256) * torch.logspace(-2, 2, rows).unsqueeze(1)  # rows of very different scales
    got = layer(x)
    fp8_weight = torch.cat([dequantize_fp8_rows(*quantize_fp8_rows(p)) for p in w.split([48, 80])])
    fp8_x = dequantize_fp8_rows(*quantize_fp8_rows(x))
    expected = F.linear(fp8_x, fp8_weight, layer.bias)
    # The GEMM rounds its sum once to bfloat16 (before the bias): half a bf16 step of the terms' sizes.
    terms = fp8_x.abs() @ fp8_weight.abs().T
    assert torch.all((got - expected).abs() <= 2.0**-8 * terms + 1e-6)
    magnitude = x.abs() @ w.abs().T
    bound = (2 * E4M3_EPS + E4M3_EPS**2 + 2.0**-8) * magnitude + 1e-6
    assert torch.all((got - F.linear(x, w, layer.bias)).abs() <= bound)


def test_scaled_mm_path_compiles_with_inductor():
    """The traced forward (per-token quantize, _scaled_mm, bias) through Inductor gives the eager result."""
    layer, _ = _fp8_layer(scaled_mm=True, sizes=(32, 16))
    x = torch.randn(9, 256)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=2.0**-7, atol=1e-5)


def test_shapes_the_fp8_gemm_cannot_take_fall_back_to_weight_only():
    """K and N must be multiples of 16 for the FP8 GEMM: a layer with another shape widens its weight."""
    layer, _ = _fp8_layer(scaled_mm=True, in_features=72, sizes=(24,), bias=False)
    assert not layer.fp8_scaled_mm
    x = torch.randn(3, 72)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight.float() * layer.weight_scale[:, None]))


def test_bfloat16_activations_widen_the_weight_exactly():
    layer, w = _fp8_layer(scaled_mm=False, dtype=torch.bfloat16)
    x = torch.randn(4, 256).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(layer.weight.to(torch.bfloat16).float(), layer.weight.float())  # every e4m3 is a bf16
    expected = F.linear(x.float(), layer.weight.float() * layer.weight_scale[:, None], layer.bias.float())
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_the_device_picks_the_forward():
    """None: the scaled GEMM only on GPUs of compute capability 8.9 and up; a CPU is weight-only."""
    layer, _ = _fp8_layer(scaled_mm=None)
    assert not layer.fp8_scaled_mm


class _Options:
    def __init__(self, options):
        self.quantization_options = options


def test_config_quantizes_every_linear_but_the_lm_head_and_takes_no_options():
    config = get_quantization_config("fp8", _Options({}))
    assert isinstance(config.linear_method("model.layers.0.mlp.gate_up_proj"), Fp8LinearMethod)
    assert config.linear_method("lm_head") is None  # vLLM's fp8 leaves the head in the model's dtype
    assert config.cache_factors()["method"] == "fp8"
    with pytest.raises(ValueError, match="fp8 takes no quantization options"):
        get_quantization_config("fp8", _Options({"group_size": 32}))


def test_a_quantized_checkpoint_tensor_is_refused():
    from compiled_llm.kernels.quantized_reference import quantize_int8

    class Config:
        def linear_method(self, prefix):
            return Fp8LinearMethod()

    layer = Linear(64, 32, quant_config=Config(), prefix="o_proj")
    with pytest.raises(ValueError, match="arrives quantized already"):
        layer.load_checkpoint("weight", quantize_int8(torch.randn(32, 64)), None)


def test_the_method_is_in_the_cache_key(tiny_llama):
    from compiled_llm.engine.arg_utils import EngineArgs
    from compiled_llm.worker.cache_factors import engine_cache_factors

    def factors(**kwargs):
        config = EngineArgs(model=tiny_llama, device="cpu", max_model_len=512, **kwargs).create_engine_config()
        return engine_cache_factors(config, 0)

    fp8 = factors(quantization="fp8")
    assert fp8["quantization"]["method"] == "fp8"
    assert fp8 != factors(quantization="int8") and fp8 != factors()


# ---- a whole model against float32 --------------------------------------------------------------------



def _with_fp8_weights(model: str, out: Path) -> str:
    """A copy of the model folder whose linear weights (not the head) are what fp8 makes of them."""
    shutil.copytree(model, out)
    path = out / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            tensors[name] = dequantize_fp8_rows(*quantize_fp8_rows(tensor)).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    return str(out)


# A tiny random model's logits are nearly flat, so e4m3's 2^-4 rounding can reorder its top 5: the
# biased Llama's fp8 tokens leave float32's top 5 on the first prompt, the plain one's stay. So the
# plain one is checked against float32, and both must give float32's tokens on their fp8 weights.
# (The bundled SmolLM2 under fp8 stays within float32's top 5 too, but takes minutes at -O0 here.)
def test_tiny_random_model_stays_within_float32s_top5(tiny_llama):
    check_close(greedy(tiny_llama, "fp8"), greedy(tiny_llama, None), "fp8", "float32")


@pytest.mark.parametrize("arch", ["llama", "llama-biased"])
def test_tiny_random_model_computes_with_its_fp8_weights(tiny_model_factory, tmp_path, arch):
    model = tiny_model_factory(arch)
    exact = check_close(greedy(model, "fp8"), greedy(_with_fp8_weights(model, tmp_path / "as-fp8"), None), "fp8",
                        "float32 on its weights")
    assert exact >= len(PROMPTS) - 1


def test_precompile_then_strict_warm_start_compiles_nothing(tiny_llama, tmp_path):
    def precompile(*extra) -> dict:
        out = subprocess.run(["compiled-llm", "precompile", tiny_llama, "--compile-cache", str(tmp_path), "--json",
                              "--max-model-len", "512", "-q", "fp8", *extra], capture_output=True, text=True,
                             timeout=1200)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold = precompile()
    assert cold["inductor_compilations"] > 0
    warm = precompile("--require-cache-hit")
    assert warm["inductor_compilations"] == 0 and warm["artifacts_loaded"] == cold["artifacts_saved"]


# ---- on a GPU -------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_gpu_layers_take_the_scaled_gemm_where_the_gpu_has_fp8():
    """On compute capability >= 8.9 the layer quantizes its tokens and calls torch._scaled_mm (bf16
    activations, as a GPU model runs); its output is within e4m3's rounding of the float product."""
    from compiled_llm.kernels.fp8_linear import scaled_mm_supported

    with torch.device("cuda"):
        layer, w = _fp8_layer(scaled_mm=None, in_features=576, sizes=(576, 192, 192), dtype=torch.bfloat16)
    assert layer.fp8_scaled_mm == scaled_mm_supported(torch.device("cuda"))
    for rows in (1, 8, 300):
        x = torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16)
        got = layer(x).float()
        w_cuda = w.cuda()
        expected = F.linear(x.float(), w_cuda, layer.bias.float())
        magnitude = x.float().abs() @ w_cuda.abs().T
        assert torch.all((got - expected).abs() <= (2 * E4M3_EPS + 2.0**-7) * magnitude + 1e-3)

