"""The Triton LoRA kernels (kernels/triton_lora.py) against the float64 per-token loop of
test_cpu_lora.py: interpreted on the CPU (in one subprocess with TRITON_INTERPRET=1, this file its
script, so the interpreter never leaks into other tests), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from tests.kernels.test_cpu_lora import check, lora_case  # noqa: E402
from tests.kernels.triton_interpreter import interpret, print_results  # noqa: E402


def check_random_cases() -> None:
    from compiled_llm.kernels.triton_lora import lora_expand, lora_shrink

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(lora_case())
    def run(case):
        check(lora_shrink, lora_expand, case)

    run()


def check_half_precision() -> None:
    """bf16 activations and stacks: float32 accumulation, within bf16's rounding."""
    from compiled_llm.kernels.triton_lora import lora_expand, lora_shrink
    from tests.kernels.test_cpu_lora import loop_expand, loop_shrink

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=g).bfloat16()
    a = torch.randn(3, 2 * 8, 64, generator=g).bfloat16()
    b = torch.randn(3, 8, 96, generator=g).bfloat16()
    scalings = torch.tensor([0.5, 1.0, 2.0]).bfloat16()
    idx = torch.tensor([0, 1, 2, -1, 2, 1, 0, -1, 1])
    y = torch.randn(9, 96, generator=g).bfloat16()
    t = lora_shrink(x, a, idx)
    torch.testing.assert_close(t.double(), loop_shrink(x, a, idx), rtol=2e-2, atol=2e-1)
    out = lora_expand(y, t, b, scalings, idx, [64, 32])
    torch.testing.assert_close(out.double(), loop_expand(y, t, b, scalings, idx, [64, 32]), rtol=2e-2, atol=5e-1)


INTERPRETED = {"random-cases": check_random_cases, "half-precision": check_half_precision}


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str | None]:
    return interpret(__file__)


@pytest.mark.parametrize("name", list(INTERPRETED))
def test_interpreted_kernels_match_float64(interpreted_results, name):
    assert name in interpreted_results, f"case {name} did not run"
    assert interpreted_results[name] is None, interpreted_results[name]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_ops_match_the_torch_reference(dtype):
    """SmolLM2's QKV shapes (576 in; 576 + 192 + 192 out), rank 16, 8 slots, decode and prefill rows,
    through the generic ops (their CUDA implementation is the Triton kernels)."""
    import compiled_llm.kernels.lora as lora

    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (1, 32, 700):
        x = torch.randn(tokens, 576, device="cuda", generator=g).to(dtype)
        a = (torch.randn(8, 48, 576, device="cuda", generator=g) * 0.05).to(dtype)
        b = (torch.randn(8, 16, 960, device="cuda", generator=g) * 0.05).to(dtype)
        scalings = torch.rand(8, device="cuda", generator=g).to(dtype)
        idx = torch.randint(-1, 8, (tokens,), device="cuda", generator=g)
        y = torch.randn(tokens, 960, device="cuda", generator=g).to(dtype)
        t = torch.ops.compiled_llm.lora_shrink(x, a, idx)
        ref_t = lora.lora_shrink_reference(x.double(), a.double(), idx)
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(t.double(), ref_t, **tol)
        out = torch.ops.compiled_llm.lora_expand(y, t, b, scalings, idx, [576, 192, 192])
        ref = lora.lora_expand_reference(y.double(), t.double(), b.double(), scalings.double(), idx, [576, 192, 192])
        torch.testing.assert_close(out.double(), ref, **tol)


if __name__ == "__main__":
    print_results(INTERPRETED)
