"""The batched LoRA kernels on a CPU (kernels/csrc/cpu_lora.cpp, and the torch reference in
kernels/lora.py that the generic op runs) against a float64 per-token loop: every token its own
slot (or -1, no adapter), fused layers with up to three output slices, a slot-index buffer longer
than the batch (the runner's is max_num_batched_tokens long), strided activations, float32 and
float16 stacks. B is given transposed, [slots, R, N], as the LoRA layers store it. The C++ expand
adds into y in place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_llm.kernels.cpu_extension import cpu_kernels_available
from compiled_llm.kernels.lora import lora_expand_reference, lora_shrink_reference


def loop_shrink(x, a, idx):
    t = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for i in range(x.shape[0]):
        if idx[i] >= 0:
            t[i] = a[idx[i]].double() @ x[i].double()
    return t


def loop_expand(y, t, bt, scalings, idx, slices):
    rank = bt.shape[1]
    out = y.double().clone()
    for i in range(y.shape[0]):
        s = int(idx[i])
        if s < 0:
            continue
        start = 0
        for j, size in enumerate(slices):
            out[i, start : start + size] += float(scalings[s]) * (
                t[i, j * rank : (j + 1) * rank].double() @ bt[s, :, start : start + size].double())
            start += size
    return out


@st.composite
def lora_case(draw):
    tokens = draw(st.integers(1, 40))
    k = draw(st.integers(1, 80))
    slices = draw(st.lists(st.integers(1, 300), min_size=1, max_size=3))
    rank = draw(st.integers(1, 20))
    slots = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    strided = draw(st.booleans())
    stack_dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, k + (7 if strided else 0), generator=g)
    x = wide[:, 3 : 3 + k] if strided else wide
    a = torch.randn(slots, len(slices) * rank, k, generator=g).to(stack_dtype)
    b = torch.randn(slots, rank, sum(slices), generator=g).to(stack_dtype)  # B transposed, as the layers store it
    scalings = torch.rand(slots, generator=g) * 2
    idx = torch.randint(-1, slots, (tokens + draw(st.integers(0, 5)),), generator=g)
    y = torch.randn(tokens, sum(slices), generator=g)
    return x, a, b, scalings, idx, y, slices


def cpp_expand(y, t, b, scalings, idx, slices):
    """The C++ expand adds into y in place: on a copy, so the case's y stays the reference."""
    out = y.clone()
    torch.ops.compiled_llm_cpu.lora_expand_(out, t, b, scalings, idx, slices)
    return out


def check(shrink, expand, case) -> None:
    x, a, b, scalings, idx, y, slices = case
    t = shrink(x, a, idx)
    torch.testing.assert_close(t.double(), loop_shrink(x, a, idx), rtol=1e-5, atol=1e-4)
    out = expand(y, t, b, scalings, idx, slices)
    torch.testing.assert_close(out.double(), loop_expand(y, t, b, scalings, idx, slices), rtol=1e-5, atol=1e-4)
    base = idx[: x.shape[0]] < 0
    assert torch.equal(out[base], y[base]), "a token without an adapter must keep its base output exactly"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lora_case())
def test_cpp_kernels_match_float64(case):
    if not cpu_kernels_available():
        pytest.skip("C++ CPU kernels not built")
    check(torch.ops.compiled_llm_cpu.lora_shrink, cpp_expand, case)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lora_case())
def test_torch_reference_matches_float64(case):
    check(lora_shrink_reference, lora_expand_reference, case)


def test_the_generic_ops_trace_as_opaque_calls():
    """Dynamo keeps both ops as single calls (their fakes give the shapes), so a compiled piece
    takes the slot indices as an input and works for any mix of adapters without recompiling."""
    import compiled_llm.kernels.lora  # noqa: F401

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x, a, b, s, idx):
        t = torch.ops.compiled_llm.lora_shrink(x, a, idx)
        return torch.ops.compiled_llm.lora_expand(x @ x.new_ones(x.shape[1], 6), t, b, s, idx, [4, 2])

    x, a, b = torch.randn(5, 8), torch.randn(2, 6, 8), torch.randn(2, 3, 6)
    s = torch.ones(2)
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    for idx in (torch.tensor([0, 1, -1, 1, 0]), torch.tensor([-1, -1, 1, 0, 0])):
        torch.testing.assert_close(compiled(x, a, b, s, idx), f(x, a, b, s, idx))
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert "compiled_llm.lora_shrink" in targets and "compiled_llm.lora_expand" in targets


def test_cpp_kernels_on_a_prefill_sized_batch():
    """Enough work that the kernels share it over threads (the random cases above run serially)."""
    if not cpu_kernels_available():
        pytest.skip("C++ CPU kernels not built")
    g = torch.Generator().manual_seed(0)
    tokens, k, rank, slices = 300, 512, 16, [512, 128, 128]
    case = (torch.randn(tokens, k, generator=g), torch.randn(4, 3 * rank, k, generator=g),
            torch.randn(4, rank, sum(slices), generator=g), torch.rand(4, generator=g),
            torch.randint(-1, 4, (tokens,), generator=g), torch.randn(tokens, sum(slices), generator=g), slices)
    check(torch.ops.compiled_llm_cpu.lora_shrink, cpp_expand, case)
    half = (*case[:1], case[1].half(), case[2].half(), *case[3:])
    check(torch.ops.compiled_llm_cpu.lora_shrink, cpp_expand, half)


def test_cpp_expand_in_a_compiled_graph_adds_in_place():
    """Inductor keeps the in-place expand on the base output (no copy of y), and the result is the
    functional reference's."""
    if not cpu_kernels_available():
        pytest.skip("C++ CPU kernels not built")
    ops = torch.ops.compiled_llm_cpu

    def f(x, w, a, b, s, idx):
        y = x @ w
        t = ops.lora_shrink(x, a, idx)
        ops.lora_expand_(y, t, b, s, idx, [4, 2])
        return torch.relu(y)

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 8, generator=g), torch.randn(8, 6, generator=g)
    a, b = torch.randn(2, 6, 8, generator=g).half(), torch.randn(2, 3, 6, generator=g).half()
    s, idx = torch.tensor([0.5, 2.0]), torch.tensor([0, 1, -1, 1, 0])
    expected = torch.relu(lora_expand_reference(x @ w, lora_shrink_reference(x, a, idx), b, s, idx, [4, 2]))
    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, a, b, s, idx), expected, rtol=1e-5, atol=1e-5)
