"""The packed-weight GEMM (compiled_llm_cpu::packed_linear) against F.linear, and the linear layers
that pack their weights for it after loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.kernels.cpu_extension import cpu_kernels_available
from compiled_llm.models.layers.linear import Linear, MergedLinear
from compiled_llm.quantization.base import pack_weight

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built")

# Looked up only where the ops exist: collecting this file must not fail where they do not (the GPU
# check runs without building them).
if cpu_kernels_available():
    pack = torch.ops.compiled_llm_cpu.pack_linear_weight
    packed_linear = torch.ops.compiled_llm_cpu.packed_linear


def with_threads(n: int):
    class Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return Threads()


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(0, 40) | st.sampled_from([63, 64, 65, 127, 300]),  # ragged decode batches and prefills
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 90),
    bias=st.booleans(),
    panel=st.sampled_from([16, 32]),  # the AVX2 and the AVX-512 layout, both checked on any CPU
    strided=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_packed_linear_matches_f_linear(rows, out_features, in_features, bias, panel, strided, threads, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, in_features * (3 if strided else 1), generator=g)
    x = wide[:, in_features : 2 * in_features] if strided else wide  # like a slice of a fused projection
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    with with_threads(threads):
        got = packed_linear(x, pack(w, panel), b, out_features)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 20) | st.sampled_from([64, 129]),
    intermediate=st.integers(1, 60),
    out_features=st.integers(1, 40),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_silu_and_mul_packed_linear_matches_the_unfused_pair(rows, intermediate, out_features, bias, seed):
    """What the SiLU-and-mul fusion pass produces equals the gate followed by the projection."""
    from compiled_llm.models.layers.activation import silu_and_mul

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * intermediate, generator=g)
    w = torch.randn(out_features, intermediate, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    got = torch.ops.compiled_llm_cpu.silu_and_mul_packed_linear(x, pack(w), b, out_features)
    torch.testing.assert_close(got, packed_linear(silu_and_mul(x), pack(w), b, out_features), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="gate and up halves"):
        torch.ops.compiled_llm_cpu.silu_and_mul_packed_linear(torch.randn(2, 5), pack(w), b, out_features)


def test_model_shapes_at_decode_and_prefill_sizes():
    """SmolLM2's projections (K = 576 and 1536) and a tall output projection, every row count the
    engine runs, against float64."""
    g = torch.Generator().manual_seed(0)
    for out_features, in_features in [(960, 576), (576, 1536), (3072, 576), (5000, 576)]:
        w = torch.randn(out_features, in_features, generator=g) / in_features**0.5
        packed = pack_weight(w)
        for rows in (1, 4, 13, 64, 257):
            x = torch.randn(rows, in_features, generator=g)
            expected = (x.double() @ w.double().T).float()
            torch.testing.assert_close(packed_linear(x, packed, None, out_features), expected, rtol=1e-4, atol=1e-4)


def test_leading_dims_and_layout():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(3, 5, 24, generator=g)
    torch.testing.assert_close(packed_linear(x, pack(w, 0), None, 40), F.linear(x, w), rtol=1e-4, atol=1e-4)
    xt = torch.randn(24, 7, generator=g).T  # last dim not contiguous
    torch.testing.assert_close(packed_linear(xt, pack(w, 0), None, 40), F.linear(xt, w), rtol=1e-4, atol=1e-4)
    packed = pack(w, 16)
    assert packed.shape == (3, 24, 16)  # [panels, in, panel width], the last panel zero-padded
    assert torch.equal(packed[2, :, 8:], torch.zeros(24, 8))
    assert torch.ops.compiled_llm_cpu.native_panel_width() in (16, 32)


def test_bad_arguments_are_clear_errors():
    w = torch.randn(20, 8)
    packed = pack(w, 16)
    with pytest.raises(RuntimeError, match="out_features 40 does not match"):
        packed_linear(torch.randn(2, 8), packed, None, 40)
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        packed_linear(torch.randn(2, 9), packed, None, 20)
    with pytest.raises(RuntimeError, match="x must be float32"):
        packed_linear(torch.randn(2, 8, dtype=torch.float64), packed, None, 20)
    with pytest.raises(RuntimeError, match="bias must be"):
        packed_linear(torch.randn(2, 8), packed, torch.randn(7), 20)
    with pytest.raises(RuntimeError, match="panel width must be 16 or 32"):
        pack(w, 24)


def test_linear_layers_pack_after_loading_and_repack_after_reloading():
    g = torch.Generator().manual_seed(2)
    layer = MergedLinear(32, [24, 40], bias=True, cpu_kernel=True)
    parts = [torch.randn(24, 32, generator=g), torch.randn(40, 32, generator=g)]
    for i, part in enumerate(parts):
        layer.load_checkpoint("weight", part, i)
    layer.bias.data.copy_(torch.randn(64, generator=g))
    assert layer.packed_weight is None  # nothing packed before the loader says it is done
    layer.process_weights_after_loading()
    x = torch.randn(5, 32, generator=g)
    expected = F.linear(x, torch.cat(parts), layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
    layer.load_checkpoint("weight", torch.zeros(24, 32), 0)  # a reload drops the stale packing
    assert layer.packed_weight is None
    torch.testing.assert_close(layer(x)[:, 24:], expected[:, 24:], rtol=1e-4, atol=1e-4)

    plain = Linear(32, 8, cpu_kernel=False)  # no C++ kernels: F.linear on the weight as loaded
    plain.weight.data.normal_()
    plain.process_weights_after_loading()
    assert plain.packed_weight is None
    torch.testing.assert_close(plain(x), F.linear(x, plain.weight))


def test_large_packed_weights_sit_on_2mb_aligned_memory_and_free_it():
    """Weights of 2 MB or more are packed into their own 2 MB-aligned mapping (which the kernel may
    back with huge pages); the results are the same, and the mapping goes with the tensor."""
    weight = torch.randn(3072, 576)  # 7 MB: SmolLM2's gate-up projection
    packed = pack_weight(weight)
    assert packed.data_ptr() % (2 << 20) == 0
    x = torch.randn(3, 576)
    torch.testing.assert_close(torch.ops.compiled_llm_cpu.packed_linear(x, packed, None, 3072), F.linear(x, weight),
                               rtol=1e-5, atol=1e-4)
    small = pack_weight(torch.randn(16, 64))  # below 2 MB: an ordinary allocation
    assert small.shape == (1, 64, small.shape[2])
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    del packed
    before = rss()
    for _ in range(50):  # 350 MB if the mappings outlived their tensors
        assert pack_weight(weight).data_ptr() % (2 << 20) == 0
    assert rss() - before < 64 << 20
