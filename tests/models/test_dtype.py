"""`--dtype auto` on a CPU: bfloat16 only where the CPU runs bf16 natively, and the choice is logged
with its reason at start-up."""

from __future__ import annotations

import pytest
import torch

import compiled_llm.config as config
from compiled_llm import LLM
from compiled_llm.config import cpu_native_bf16, describe_cpu_dtype, resolve_dtype

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def choice_by_flags(monkeypatch):
    """The suite pins `auto` to float32 (tests/conftest.py); here `auto` chooses by the CPU's flags."""
    monkeypatch.delenv(config.AUTO_CPU_DTYPE_ENV, raising=False)


def test_the_environment_can_pin_auto(monkeypatch):
    monkeypatch.setenv(config.AUTO_CPU_DTYPE_ENV, "float32")
    assert resolve_dtype("auto", None, CPU) == torch.float32
    assert config.AUTO_CPU_DTYPE_ENV in describe_cpu_dtype(torch.float32)
    monkeypatch.setenv(config.AUTO_CPU_DTYPE_ENV, "float16")
    with pytest.raises(ValueError, match="use float32 or bfloat16"):
        resolve_dtype("auto", None, CPU)


def test_auto_follows_this_cpu():
    expected = torch.bfloat16 if cpu_native_bf16() else torch.float32
    assert resolve_dtype("auto", None, CPU) == expected
    assert resolve_dtype("float32", None, CPU) == torch.float32
    with pytest.raises(ValueError, match="Unknown dtype 'fp8'"):
        resolve_dtype("fp8", None, CPU)


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "fma"}, torch.float32),  # Zen 3: bf16 would be emulated
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),  # Zen 4/5, Cooper Lake
    ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),  # Sapphire Rapids
])
def test_auto_by_cpu_flags(monkeypatch, flags, expected):
    """Other CPUs' flags, as /proc/cpuinfo spells them (this machine has only its own)."""
    monkeypatch.setattr(config, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype("auto", None, CPU) == expected
    reason = describe_cpu_dtype(expected)
    if expected == torch.bfloat16:
        assert "avx512_bf16" in reason or "amx_bf16" in reason
    else:
        assert "no native bf16" in reason
        assert "100x slower" in describe_cpu_dtype(torch.bfloat16)  # asked for anyway: say what it costs


def test_start_up_logs_threads_and_dtype(tiny_llama, package_log):
    threads = torch.get_num_threads()  # the offline engine runs in this process and sets them
    try:
        LLM(tiny_llama, optimization_level=0, max_model_len=64, kv_cache_memory_bytes=1 << 20, num_threads=1)
    finally:
        torch.set_num_threads(threads)
    line = next(m for m in package_log.messages if m.startswith("CPU: "))
    assert "1 threads" in line and describe_cpu_dtype(resolve_dtype("auto", None, CPU)) in line
