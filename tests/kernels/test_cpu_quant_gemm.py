"""The GEMMs over quantized (8- and 4-bit) and 16-bit weights (compiled_llm_cpu::quantized_linear,
half_linear) against their torch references, and GGUF's blocks against the gguf package's own
de-quantizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.kernels import quantized_reference as ref
from compiled_llm.kernels.cpu_extension import cpu_kernels_available
from compiled_llm.kernels.gguf_blocks import BLOCK_BYTES, blocks_to_quantized
from compiled_llm.quantization.weight_only import quantizes_activations

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels could not be built")

if cpu_kernels_available():
    ops = torch.ops.compiled_llm_cpu

EPS32 = 2.0**-24  # float32's unit roundoff


def assert_within_rounding(
    got: torch.Tensor, x: torch.Tensor, terms: torch.Tensor, bias: torch.Tensor | None, expected: torch.Tensor
) -> None:
    """|got - expected| <= (K + 8) * eps * (sum_k |x_k| terms[n, k] + |b_n|), elementwise.

    Why this bound: kernel and reference use the same float32 weights up to a rounding or two (a
    GGUF scale times q is exact; elsewhere the kernel's fused s q + m and the reference's s q, then
    + m, are each within eps * (|s q| + |m|) of the exact weight; 16-bit weights convert exactly),
    and differ otherwise only in the order of the float32 sums and, for few rows, in computing
    s * sum(q x) + m * sum(x) per group. A float32 sum of K products, in any order and grouping,
    errs by at most about K * eps times the sum of their magnitudes; `terms` holds those magnitudes
    per weight (|s q| + |m| for quantized weights, |w| for 16-bit ones), and the bias adds one
    rounding. `expected` is computed in float64.
    """
    k = x.shape[-1]
    magnitude = x.double().abs() @ terms.double().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    bound = (k + 8) * EPS32 * magnitude
    err = (got.double() - expected).abs()
    assert torch.all(err <= bound), f"max error {err.max():.3g}, max excess {(err - bound).max():.3g}"


def magnitudes(weight: ref.QuantizedWeight) -> torch.Tensor:
    """|s q| + |m| per weight."""
    k = weight.shape[1]
    t = (weight.q.double() * weight.scales.double().repeat_interleave(weight.group_size, dim=1)[:, :k]).abs()
    if weight.mins is not None:
        t = t + weight.mins.double().abs().repeat_interleave(weight.group_size, dim=1)[:, :k]
    return t


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y + bias.double() if bias is not None else y


def assert_quantized_linear(
    got: torch.Tensor, x: torch.Tensor, weight: ref.QuantizedWeight, bias: torch.Tensor | None, panel: int = 0
) -> None:
    """`got` is x W^T + b within float32 rounding, x taken as the kernel takes it: quantized to int8
    per block of 32 on the int8-activation path (its bound then counts the larger of |x| and |x
    quantized| per input), as it is elsewhere."""
    if quantizes_activations(weight.bits, panel):
        bound_x = torch.maximum(x.double().abs(), ref.int8_activations(x).abs())
        assert_within_rounding(got, bound_x, magnitudes(weight), bias, ref.int8_activation_linear(x, weight, bias))
    else:
        assert_within_rounding(got, x, magnitudes(weight), bias, reference(x, ref.dequantize(weight), bias))


def with_threads(n: int):
    class Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return Threads()


def quantize(w: torch.Tensor, bits: int, group_size: int) -> ref.QuantizedWeight:
    return ref.quantize_int8(w, group_size) if bits == 8 else ref.quantize_int4(w, group_size)


def with_fp16_scales(weight: ref.QuantizedWeight) -> ref.QuantizedWeight:
    """The weight with its scales and mins rounded to fp16, as GGUF's blocks hold them (the weight it
    stands for changes a little; kernel and reference both compute with the rounded one)."""
    mins = None if weight.mins is None else weight.mins.half()
    return ref.QuantizedWeight(weight.q, weight.scales.half(), mins, weight.bits, weight.group_size)


def run_quantized(
    x: torch.Tensor, weight: ref.QuantizedWeight, bias: torch.Tensor | None, panel: int = 0
) -> torch.Tensor:
    n, k = weight.shape
    packed = ops.pack_quantized_weight(weight.q, weight.scales, weight.mins, weight.bits, weight.group_size, panel)
    return ops.quantized_linear(x, packed, bias, n, k, weight.bits, weight.group_size)


@st.composite
def in_features_and_group(draw) -> tuple[int, int]:
    k = 32 * draw(st.integers(1, 12))
    return k, draw(st.sampled_from([32, 64, 128, k]))  # a shorter last group where k is not a multiple


@settings(max_examples=70, deadline=None)
@given(
    rows=st.integers(0, 70) | st.sampled_from([127, 300]),  # decode batches (few- and many-row kernels), prefills
    out_features=st.integers(1, 90),  # odd counts leave a partial last panel
    k_group=in_features_and_group(),
    bits=st.sampled_from([8, 4]),
    bias=st.booleans(),
    panel=st.sampled_from([16, 32]),  # the AVX2 and the AVX-512 layout, both checked on any CPU
    strided=st.booleans(),
    threads=st.sampled_from([1, 2]),
    fp16_scales=st.booleans(),  # GGUF's layout, and the float32 one of weights quantized at load
    seed=st.integers(0, 2**16),
)
def test_quantized_linear_matches_the_reference(
    rows, out_features, k_group, bits, bias, panel, strided, threads, fp16_scales, seed
):
    in_features, group = k_group
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, in_features * (3 if strided else 1), generator=g)
    x = wide[:, in_features : 2 * in_features] if strided else wide  # like a slice of a fused projection
    weight = quantize(torch.randn(out_features, in_features, generator=g), bits, group)
    if fp16_scales:
        weight = with_fp16_scales(weight)
    b = torch.randn(out_features, generator=g) if bias else None
    with with_threads(threads):
        got = run_quantized(x, weight, b, panel)
    assert got.shape == (rows, out_features)
    assert_quantized_linear(got, x, weight, b, panel)


def int8_activation_layouts() -> list[tuple[int, int]]:
    """The (bits, panel width) whose weights compute with int8 activations in this build: (4, 16)
    with AVX2; (8, 32) and (4, 32) too with AVX512-VNNI."""
    if not cpu_kernels_available():
        return []
    return [(b, p) for b in (8, 4) for p in (16, 32) if ops.quantized_linear_int8_activations(b, p)]


@pytest.mark.skipif(not int8_activation_layouts(), reason="the int8-activation paths are built only with AVX2")
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(2, 40), k_group=in_features_and_group(), fp16_scales=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16),
       layout=st.sampled_from(int8_activation_layouts() or [(4, 16)]))
def test_int8_activation_rows_do_not_depend_on_the_call(rows, k_group, fp16_scales, threads, seed, layout):
    """A row's result is bit for bit the same alone or among any others: a request verified with k
    drafts gets the logits it gets decoded one token at a time, which greedy speculation needs."""
    in_features, group = k_group
    bits, panel = layout
    g = torch.Generator().manual_seed(seed)
    weight = quantize(torch.randn(37, in_features, generator=g), bits, group)
    if fp16_scales:
        weight = with_fp16_scales(weight)
    x = torch.randn(rows, in_features, generator=g) * torch.rand(rows, 1, generator=g) * 10
    with with_threads(threads):
        together = run_quantized(x, weight, None, panel)
        alone = torch.cat([run_quantized(x[i : i + 1], weight, None, panel) for i in range(rows)])
        tail = run_quantized(x[rows // 2 :], weight, None, panel)
    assert torch.equal(together, alone)
    assert torch.equal(together[rows // 2 :], tail)


@pytest.mark.skipif(not int8_activation_layouts(), reason="the int8-activation paths are built only with AVX2")
@pytest.mark.parametrize("layout", int8_activation_layouts() or [(4, 16)])
def test_int8_activations_stay_close_to_float_ones(layout):
    """On SmolLM2's shapes, int8 activations per block of 32 move y by about 1% of its size (2-3% where
    a few features are 30 times the others, as in a model's residual stream), as llama.cpp's Q8
    activations do; what that costs a model is measured as perplexity (benchmarks/perplexity.py)."""
    bits, panel = layout
    g = torch.Generator().manual_seed(0)
    for out_features, in_features in [(960, 576), (576, 1536)]:
        weight = with_fp16_scales(quantize(torch.randn(out_features, in_features, generator=g), bits, 32))
        for outliers, bound in [(1, 0.015), (30, 0.035)]:
            x = torch.randn(8, in_features, generator=g)
            x[:, ::97] *= outliers
            got = run_quantized(x, weight, None, panel).double()
            exact = reference(x, ref.dequantize(weight), None)
            assert (got - exact).norm() / exact.norm() < bound
            assert torch.nn.functional.cosine_similarity(got, exact, dim=1).min() > 0.999


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 40) | st.sampled_from([63, 127, 300]),
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 90),  # 16-bit weights take any K
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    bias=st.booleans(),
    panel=st.sampled_from([16, 32]),
    strided=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_half_linear_matches_the_reference(rows, out_features, in_features, dtype, bias, panel, strided, threads, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, in_features * (3 if strided else 1), generator=g)
    x = wide[:, in_features : 2 * in_features] if strided else wide
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g) if bias else None
    with with_threads(threads):
        got = ops.half_linear(x, ops.pack_half_weight(w, panel), b, out_features)
    assert_within_rounding(got, x, w.float().abs(), b, reference(x, w.float(), b))


def test_fp16_conversion_is_exact_for_every_value():
    """All 65536 fp16 bit patterns (subnormals, infinities and NaNs included) through the GEMM: one
    input row of 1.0 against a weight whose rows each hold one value, so y is the value itself."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    w = torch.zeros(65536, 32, dtype=torch.float16)
    w[:, 0] = bits
    got = ops.half_linear(torch.eye(32)[:1], ops.pack_half_weight(w, 0), None, 65536)[0]
    expected = bits.float()
    finite = expected.isfinite()
    assert torch.equal(got[finite], expected[finite])
    assert torch.equal(got[expected.isinf()], expected[expected.isinf()])
    assert got[expected.isnan()].isnan().all()


FORMATS = {  # GGUF's groups of 32 (fp16 scales), gpt-fast's int4 groups of 128, per-channel int8, 16-bit storage
    "Q8_0": lambda w: with_fp16_scales(ref.quantize_int8(w, 32)),
    "Q4_1": lambda w: with_fp16_scales(ref.quantize_int4(w, 32)),
    "int4-g32": lambda w: ref.quantize_int4(w, 32),
    "int4-g128": lambda w: ref.quantize_int4(w, 128),
    "int8-channel": lambda w: ref.quantize_int8(w),
    "float16": lambda w: w.half(),
    "bfloat16": lambda w: w.bfloat16(),
}


def packed_linear_of(weight: ref.QuantizedWeight | torch.Tensor):
    """(the kernel's linear, a check of its result for an x) for a weight in any format."""
    n, k = weight.shape
    if isinstance(weight, torch.Tensor):
        packed = ops.pack_half_weight(weight, 0)
        dense = weight.float()
        return (lambda x: ops.half_linear(x, packed, None, n),
                lambda got, x: assert_within_rounding(got, x, dense.abs(), None, reference(x, dense, None)))
    packed = ops.pack_quantized_weight(weight.q, weight.scales, weight.mins, weight.bits, weight.group_size, 0)
    return (lambda x: ops.quantized_linear(x, packed, None, n, k, weight.bits, weight.group_size),
            lambda got, x: assert_quantized_linear(got, x, weight, None))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_model_shapes_at_decode_and_prefill_sizes(fmt):
    """SmolLM2's projections (K = 576, whose groups of 128 end with one of 64, and K = 1536) and a
    tall output projection, at the row counts the engine runs, in every format."""
    g = torch.Generator().manual_seed(0)
    for out_features, in_features in [(960, 576), (576, 1536), (5000, 576)]:
        w = torch.randn(out_features, in_features, generator=g) / in_features**0.5
        run, check = packed_linear_of(FORMATS[fmt](w))
        for rows in (1, 4, 13, 64, 257):
            x = torch.randn(rows, in_features, generator=g)
            check(run(x), x)


def random_gguf_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes of `kind`, shaped as the gguf package reads a tensor: [rows, bytes per row].
    Scales are finite fp16 values over a wide range (subnormals included); quants are any bytes."""
    n_blocks = rows * cols // 32
    blocks = rng.integers(0, 256, size=(n_blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = 2 if kind == "Q4_1" else 1
    magnitude = 10.0 ** rng.integers(-7, 2, (n_blocks, halves))
    values = (rng.standard_normal((n_blocks, halves)) * magnitude).astype(np.float16)
    blocks[:, : 2 * halves] = values.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_decode_as_the_gguf_package_and_multiply(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    rows, cols = 67, 192
    data = random_gguf_blocks(kind, rows, cols, rng)
    weight = blocks_to_quantized(data, kind, (rows, cols))
    expected = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).reshape(rows, cols))
    assert torch.equal(ref.dequantize(weight), expected)  # bit for bit
    assert weight.group_size == 32 and weight.bits == (8 if kind == "Q8_0" else 4)
    assert weight.scales.dtype == torch.float16  # as in the file: the packed weight keeps them so
    assert weight.mins is None or weight.mins.dtype == torch.float16
    for rows_x in (1, 3, 20):
        x = torch.randn(rows_x, cols)
        assert_quantized_linear(run_quantized(x, weight, None), x, weight, None)


def test_q4_0_scales_whose_minus_8_d_overflows_fp16_become_float32():
    """Q4_0's min -8 d is exact in fp16 unless |d| > 8188: then the tensor's scales and mins are float32,
    and the weights still de-quantize bit for bit as the gguf package's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    data = random_gguf_blocks("Q4_0", 3, 64, rng)
    data.reshape(6, -1)[2, :2] = np.array([-9000.0], np.float16).view(np.uint8)
    weight = blocks_to_quantized(data, "Q4_0", (3, 64))
    assert weight.scales.dtype == weight.mins.dtype == torch.float32
    expected = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q4_0).reshape(3, 64))
    assert torch.equal(ref.dequantize(weight), expected)
    x = torch.randn(2, 64)
    assert_quantized_linear(run_quantized(x, weight, None), x, weight, None)


def test_fp16_scales_make_q4_1_read_as_many_bytes_as_llama_cpp():
    """0.625 bytes per weight for Q4_1 (16 nibble bytes, fp16 d and m per 32), 1.0625 for Q8_0."""
    w = torch.randn(64, 576)
    for weight, per_weight in [(with_fp16_scales(ref.quantize_int4(w, 32)), 0.625),
                               (with_fp16_scales(ref.quantize_int8(w, 32)), 1.0625),
                               (ref.quantize_int4(w, 32), 0.75)]:
        packed = ops.pack_quantized_weight(weight.q, weight.scales, weight.mins, weight.bits, 32, 0)
        assert packed.nbytes == 64 * 576 * per_weight


def test_packed_layout():
    """[panels, panel bytes], per group: NR scales, NR mins, then the group's nibbles, k-major; the last
    group shorter where K is not a multiple of the group size; the last panel zero-padded."""
    w = ref.quantize_int4(torch.randn(20, 96), 64)  # groups of 64 and 32
    packed = ops.pack_quantized_weight(w.q, w.scales, w.mins, 4, 64, 16)
    block = 16 * 8 + 64 * 8
    assert packed.shape == (2, block + 16 * 8 + 32 * 8) and packed.dtype == torch.uint8
    scales = packed[1, :64].view(torch.float32)
    assert torch.equal(scales[:4], w.scales[16:, 0]) and torch.equal(scales[4:], torch.zeros(12))
    mins = packed[0, block + 64 : block + 128].view(torch.float32)
    assert torch.equal(mins, w.mins[:16, 1])
    nibbles = packed[0, block + 128 :].reshape(32, 8)  # k, byte i: feature i low, feature 8 + i high
    assert torch.equal(nibbles & 15, w.q[:8, 64:].T) and torch.equal(nibbles >> 4, w.q[8:16, 64:].T)
    half = with_fp16_scales(w)  # the same with 2-byte scales and mins
    packed = ops.pack_quantized_weight(half.q, half.scales, half.mins, 4, 64, 16)
    block = 16 * 4 + 64 * 8
    assert packed.shape == (2, block + 16 * 4 + 32 * 8)
    assert torch.equal(packed[1, :32].view(torch.float16)[:4], half.scales[16:, 0])
    assert torch.equal(packed[0, block + 32 : block + 64].view(torch.float16), half.mins[:16, 1])
    assert torch.equal(packed[0, block + 64 :].reshape(32, 8) & 15, w.q[:8, 64:].T)
    assert ops.pack_half_weight(torch.randn(40, 24).half(), 16).shape == (3, 24, 16)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_packed_weights_lie_in_packing_order_on_shared_chunks_and_are_freed():
    """Packed weights are carved one after another (64-byte aligned) from shared 2 MB-aligned chunks
    that the kernel may back with huge pages, so a forward pass reads them as one stream; a chunk's
    memory goes with the last tensor in it."""
    w = ref.quantize_int4(torch.randn(96, 576), 32)
    first = ops.pack_quantized_weight(w.q, w.scales, w.mins, 4, 32, 0)
    second = ops.pack_half_weight(torch.randn(40, 64).half(), 0)
    after_first = first.data_ptr() + (first.nbytes + 63) // 64 * 64
    assert second.data_ptr() == after_first or second.data_ptr() % (2 << 20) == 0  # next, or a new chunk
    assert first.data_ptr() % 64 == 0
    q8 = ref.quantize_int8(torch.randn(4096, 576))  # 2.4 MB packed
    del first, second
    before = rss()
    for _ in range(200):  # 480 MB if chunks outlived their tensors
        packed = ops.pack_quantized_weight(q8.q, q8.scales, None, 8, 576, 0)
        assert packed.data_ptr() % 64 == 0
        del packed
    assert rss() - before < 160 << 20  # at most the chunk being filled and the one before it


def test_fake_kernels_give_the_shapes():
    """Dynamo and Inductor trace the ops with fake tensors: every op that returns a tensor has a fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = ref.quantize_int4(torch.randn(40, 64), 32)
    half = torch.randn(40, 64).bfloat16()
    packed = ops.pack_quantized_weight(w.q, w.scales, w.mins, 4, 32, 16)
    packed_half = ops.pack_half_weight(half, 32)
    fp16_scaled = [(weight, ops.pack_quantized_weight(weight.q, weight.scales, weight.mins, weight.bits, 32, 16))
                   for weight in (with_fp16_scales(w), with_fp16_scales(ref.quantize_int8(torch.randn(40, 64), 32)))]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(5, 7, 64))
        assert ops.quantized_linear(x, mode.from_tensor(packed), None, 40, 64, 4, 32).shape == (5, 7, 40)
        assert ops.half_linear(x, mode.from_tensor(packed_half), None, 40).shape == (5, 7, 40)
        fake_w = mode.from_tensor(w.q)
        got = ops.pack_quantized_weight(fake_w, mode.from_tensor(w.scales), mode.from_tensor(w.mins), 4, 32, 16)
        assert got.shape == packed.shape and got.dtype == torch.uint8
        for weight, real in fp16_scaled:  # 2-byte scales and mins: narrower panels
            mins = None if weight.mins is None else mode.from_tensor(weight.mins)
            fake = ops.pack_quantized_weight(mode.from_tensor(weight.q), mode.from_tensor(weight.scales), mins,
                                             weight.bits, 32, 16)
            assert fake.shape == real.shape
        assert ops.pack_half_weight(mode.from_tensor(half), 32).shape == packed_half.shape


def test_bad_arguments_are_clear_errors():
    w4 = ref.quantize_int4(torch.randn(20, 64), 32)
    w8 = ref.quantize_int8(torch.randn(20, 64), 32)
    pack = ops.pack_quantized_weight
    with pytest.raises(RuntimeError, match="in_features must be a multiple of 32 for quantized weights, got 48"):
        pack(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1), None, 8, 48, 0)
    with pytest.raises(RuntimeError, match="group_size must be 32, 64, 128 or in_features"):
        pack(w8.q, torch.ones(20, 4), None, 8, 16, 0)
    with pytest.raises(RuntimeError, match="bits must be 8 or 4"):
        pack(w8.q, w8.scales, None, 2, 32, 0)
    with pytest.raises(RuntimeError, match="8-bit q must be int8"):
        pack(w8.q.float(), w8.scales, None, 8, 32, 0)
    with pytest.raises(RuntimeError, match="8-bit weights are symmetric: mins must be None"):
        pack(w8.q, w8.scales, w8.scales, 8, 32, 0)
    with pytest.raises(RuntimeError, match="4-bit q must be uint8"):
        pack(w8.q, w4.scales, w4.mins, 4, 32, 0)
    with pytest.raises(RuntimeError, match="4-bit weights need mins"):
        pack(w4.q, w4.scales, None, 4, 32, 0)
    with pytest.raises(RuntimeError, match="4-bit q must hold values 0..15, found 16"):
        pack(w4.q + 1, w4.scales, w4.mins, 4, 32, 0)
    with pytest.raises(RuntimeError, match=r"scales must be \[out_features, ceil\(in_features / group_size\)\]"):
        pack(w4.q, w4.scales[:, :1], w4.mins, 4, 32, 0)
    with pytest.raises(RuntimeError, match=r"mins must have the scales' dtype \(Float\), got Half"):
        pack(w4.q, w4.scales, w4.mins.half(), 4, 32, 0)
    with pytest.raises(RuntimeError, match="scales must be float32 or float16, got BFloat16"):
        pack(w4.q, w4.scales.bfloat16(), w4.mins.bfloat16(), 4, 32, 0)
    with pytest.raises(RuntimeError, match="panel width must be 16 or 32"):
        pack(w4.q, w4.scales, w4.mins, 4, 32, 24)

    packed = pack(w4.q, w4.scales, w4.mins, 4, 32, 16)
    linear = ops.quantized_linear
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        linear(torch.randn(3, 32), packed, None, 20, 64, 4, 32)
    with pytest.raises(RuntimeError, match="x must be float32"):
        linear(x.double(), packed, None, 20, 64, 4, 32)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        linear(x, packed, torch.randn(7), 20, 64, 4, 32)
    with pytest.raises(RuntimeError, match="out_features 40 does not match"):
        linear(x, packed, None, 40, 64, 4, 32)
    with pytest.raises(RuntimeError, match="was not packed with in_features 64, bits 8 and group_size 32"):
        linear(x, packed, None, 20, 64, 8, 32)
    with pytest.raises(RuntimeError, match="was not packed with in_features 64, bits 4 and group_size 64"):
        linear(x, packed, None, 20, 64, 4, 64)
    with pytest.raises(RuntimeError, match="packed weight must come from pack_quantized_weight"):
        linear(x, packed.view(2, 2, -1), None, 20, 64, 4, 32)

    with pytest.raises(RuntimeError, match="weight must be a 2-D float16 or bfloat16 tensor"):
        ops.pack_half_weight(torch.randn(4, 8), 0)
    with pytest.raises(RuntimeError, match="packed weight must come from pack_half_weight"):
        ops.half_linear(x, torch.randn(2, 64, 16), None, 20)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        ops.half_linear(torch.randn(3, 32), ops.pack_half_weight(torch.randn(20, 64).half(), 0), None, 20)

    with pytest.raises(ValueError, match="unsupported GGUF block type 'Q5_0'"):
        blocks_to_quantized(bytes(22), "Q5_0", (1, 32))
    with pytest.raises(ValueError, match="48 columns is not a multiple"):
        blocks_to_quantized(bytes(20), "Q4_1", (1, 48))
    with pytest.raises(ValueError, match=r"shape \(2, 64\) takes 80 bytes, got 79"):
        blocks_to_quantized(bytes(79), "Q4_1", (2, 64))
