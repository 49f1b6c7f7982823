"""Choosing a weight format: the names, their options, the errors, and the compile-cache key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compiled_llm.config import QUANTIZATION_NAMES
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.entrypoints.cli import build_parser
from compiled_llm.quantization import QUANTIZATION_METHODS
from compiled_llm.worker.cache_factors import engine_cache_factors


def _config(model: str, **kwargs):
    return EngineArgs(model=model, device="cpu", max_model_len=512, **kwargs).create_engine_config()


def test_the_flag_offers_every_registered_method():
    assert set(QUANTIZATION_METHODS) == set(QUANTIZATION_NAMES)


def test_an_unknown_method_is_a_clear_error(tiny_llama, capsys):
    with pytest.raises(ValueError, match="Unknown quantization method 'int3'; known: int8, int4"):
        _config(tiny_llama, quantization="int3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_int4_options_are_checked(tiny_llama):
    mc = _config(tiny_llama, quantization="int4", quantization_options={"group_size": 32}).model_config
    assert (mc.quantization, mc.quantization_options) == ("int4", {"group_size": 32})
    from compiled_llm.quantization import get_quantization_config

    with pytest.raises(ValueError, match="group_size must be one of 32, 64, 128"):
        get_quantization_config("int4", _config(tiny_llama, quantization="int4",
                                                quantization_options={"group_size": 48}).model_config)
    with pytest.raises(ValueError, match="int8 takes no quantization options"):
        get_quantization_config("int8", _config(tiny_llama, quantization="int8",
                                                quantization_options={"group_size": 32}).model_config)


def test_the_method_and_its_parameters_are_in_the_cache_key(tiny_llama):
    keys = {}
    for name, kwargs in {"fp32": {}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
                         "int4-g128": {"quantization": "int4", "quantization_options": {"group_size": 128}}}.items():
        factors = engine_cache_factors(_config(tiny_llama, **kwargs), 0)
        keys[name] = repr(sorted(factors.items()))
    assert len(set(keys.values())) == 4
    assert "quantization" not in engine_cache_factors(_config(tiny_llama), 0)  # unquantized keys unchanged


def test_a_16_bit_dtype_without_native_compute_stores_weights_in_16_bits(tiny_llama, monkeypatch):
    """fp16 on any CPU, bf16 on one without AMX or avx512_bf16: float32 activations over 16-bit weights."""
    mc = _config(tiny_llama, dtype="float16").model_config
    assert (mc.dtype, mc.quantization, mc.quantization_options) == (torch.float32, "fp16_storage",
                                                                    {"dtype": "float16"})
    monkeypatch.setattr("compiled_llm.config.cpu_native_bf16", lambda: None)
    mc = _config(tiny_llama, dtype="bfloat16").model_config
    assert (mc.dtype, mc.quantization, mc.quantization_options) == (torch.float32, "fp16_storage",
                                                                    {"dtype": "bfloat16"})
    monkeypatch.setattr("compiled_llm.config.cpu_native_bf16", lambda: "amx_bf16")
    mc = _config(tiny_llama, dtype="bfloat16").model_config
    assert (mc.dtype, mc.quantization) == (torch.bfloat16, None)  # native bf16: computed in bf16
    with pytest.raises(ValueError, match="fp16_storage stores the weights in --dtype bfloat16 or float16"):
        _config(tiny_llama, quantization="fp16_storage", dtype="float32")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_auto_dtype_is_float32_for_the_methods_whose_cpu_gemm_takes_float32(tiny_llama, monkeypatch, method):
    """On a CPU with native bf16, `auto` would pick bf16 activations, which the int8/int4 C++ GEMM
    does not take: every step would de-quantize whole weights instead (measured here: 1.8 tok/s at
    batch 1 against 144 for the same bits with float32 activations)."""
    monkeypatch.setenv("COMPILED_LLM_CPU_AUTO_DTYPE", "bfloat16")
    monkeypatch.setattr("compiled_llm.config.cpu_native_bf16", lambda: "amx_bf16")  # bf16 as it is, on any CPU
    assert _config(tiny_llama).model_config.dtype == torch.bfloat16
    mc = _config(tiny_llama, quantization=method).model_config
    assert (mc.dtype, mc.quantization) == (torch.float32, method)
    mc = _config(tiny_llama, quantization=method, dtype="bfloat16").model_config  # asked for: kept
    assert mc.dtype == torch.bfloat16


def test_auto_on_avx512_bf16_without_amx_stores_bf16_under_float32_activations(tiny_llama, monkeypatch):
    """There our bf16 matmuls decode at 0.6x float32 while bf16 storage decodes at 1.7x (Zen 5):
    `auto` stores bf16 weights and computes in float32; AMX, or an explicit bfloat16, computes in bf16."""
    monkeypatch.delenv("COMPILED_LLM_CPU_AUTO_DTYPE", raising=False)
    monkeypatch.setattr("compiled_llm.config.cpu_native_bf16", lambda: "avx512_bf16")
    mc = _config(tiny_llama).model_config
    assert (mc.dtype, mc.quantization, mc.quantization_options) == (torch.float32, "fp16_storage",
                                                                    {"dtype": "bfloat16"})
    assert (_config(tiny_llama, dtype="bfloat16").model_config.dtype) == torch.bfloat16
    monkeypatch.setattr("compiled_llm.config.cpu_native_bf16", lambda: "amx_bf16")
    mc = _config(tiny_llama).model_config
    assert (mc.dtype, mc.quantization) == (torch.bfloat16, None)


def test_the_bundled_model_is_served_from_its_shipped_file_on_a_cpu_and_its_conversion_is_one_flag_away():
    shipped = EngineArgs(device="cpu", max_model_len=512).create_engine_config().model_config
    assert shipped.quantization == "gguf" and shipped.model.endswith("Q4_1.gguf")
    assert shipped.served_model_name == "SmolLM2-135M-Instruct" and shipped.dtype == torch.float32
    converted = EngineArgs(device="cpu", max_model_len=512, quantization="none").create_engine_config().model_config
    assert converted.quantization is None and (Path(converted.model) / "config.json").is_file()
    int8 = EngineArgs(device="cpu", max_model_len=512, quantization="int8").create_engine_config().model_config
    assert int8.quantization == "int8" and int8.model == converted.model  # quantized from the float32 folder
    assert build_parser().parse_args(["serve", "-q", "none"]).quantization == "none"
