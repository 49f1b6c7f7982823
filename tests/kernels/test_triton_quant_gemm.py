"""The Triton GEMM over quantized weights (kernels/triton_quant_gemm.py) and its op against the torch
reference (kernels/quantized_reference.py): interpreted on the CPU, compiled on a GPU.

The CPU cases run in one subprocess with TRITON_INTERPRET=1 (this file is its script), so the
interpreter never leaks into other tests; Hypothesis draws the shapes there (ragged row and output
counts, K a multiple of the group, every group size and format, each activation dtype, bias or
not, strided inputs). The interpreter cannot tl.dot bfloat16, so there a bfloat16 tile is widened to
float32 for the dot; the bfloat16 dot itself runs in the `cuda` tests only. What the interpreter
cannot see (the lowering for tensor cores) is checked by compiling the kernel for Ampere and Hopper
with Triton's own compiler, which needs no GPU.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from compiled_llm.kernels import quantized_reference as ref  # noqa: E402
from compiled_llm.kernels.gguf_blocks import BLOCK_BYTES, blocks_to_quantized  # noqa: E402
from compiled_llm.kernels.gpu_quant_linear import gpu_layout, pack_nibbles  # noqa: E402
from tests.kernels.triton_interpreter import interpret, print_results  # noqa: E402

EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # unit roundoffs
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# name -> (bits, group size; None: per output channel, symmetric 4-bit: Q4_0's min of -8 scales)
QUANTIZERS = {"int8": (8, None), "int8-g32": (8, 32), "int4-g32": (4, 32), "int4-g64": (4, 64),
              "int4-g128": (4, 128), "int4-sym-g32": (4, -32)}
GGUF_KINDS = ("Q8_0", "Q4_0", "Q4_1")


def quantized_weight(fmt: str, n: int, k: int, seed: int) -> ref.QuantizedWeight:
    """A random [n, k] weight in format `fmt`: a quantizer's, or a GGUF block type's own bytes."""
    g = torch.Generator().manual_seed(seed)
    if fmt in GGUF_KINDS:
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, size=(n * k // 32, BLOCK_BYTES[fmt]), dtype=np.uint8)
        halves = 2 if fmt == "Q4_1" else 1  # fp16 scales (and mins) of a trained model's magnitudes
        values = (rng.standard_normal((n * k // 32, halves)) * 10.0 ** rng.integers(-4, -1, (n * k // 32, 1)))
        blocks[:, : 2 * halves] = values.astype(np.float16).view(np.uint8)
        return blocks_to_quantized(blocks, fmt, (n, k))
    bits, group = QUANTIZERS[fmt]
    w = torch.randn(n, k, generator=g) * 0.05
    if bits == 8:
        return ref.quantize_int8(w, group)
    if group < 0:  # symmetric: w = s (q - 8), kept as s q + (-8 s)
        scales = torch.rand(n, k // -group, generator=g) * 0.01 + 1e-4
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        return ref.QuantizedWeight(q, scales, -8 * scales, 4, -group)
    return ref.quantize_int4(w, group)


def check_gemm(fmt: str, rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, strided: bool,
               device: str, seed: int = 0) -> None:
    """quant_gemm's output is within rounding of x dequant(W)^T + b computed in float64.

    Bound, elementwise: (2 eps_dtype + (K + 8) eps_fp32) (|x| |W|^T + |b|). The kernel widens the
    weight exactly to float32 (s q, + m: a rounding or two), rounds it once to the activations'
    dtype for the dot (not for per-channel int8, whose scale multiplies the sum), sums in float32 in
    its own order, and rounds the output once.
    """
    weight = quantized_weight(fmt, n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, 2 * k if strided else k, generator=g).to(dtype)
    x = x[:, ::2] if strided else x  # a strided view, as a sliced activation would be
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    q, scales, mins = gpu_layout(weight, torch.device(device))
    got = torch.ops.compiled_llm.quant_gemm(x.to(device), q, scales, mins, None if b is None else b.to(device),
                                            weight.bits, weight.group_size)
    assert got.dtype == dtype and got.shape == (rows, n)
    w, x64 = ref.dequantize(weight).to(device, torch.float64), x.to(device, torch.float64)
    b64 = 0 if b is None else b.to(device, torch.float64)
    expected = x64 @ w.T + b64
    magnitude = x64.abs() @ w.abs().T + abs(b64)
    bound = (2 * EPS[dtype] + (k + 8) * EPS[torch.float32]) * magnitude + 1e-30
    err = (got.double() - expected).abs()
    assert torch.all(err <= bound), f"{fmt} {dtype}: max error {err.max():.3g}, max excess {(err - bound).max():.3g}"


@st.composite
def gemm_case(draw, formats: tuple[str, ...]):
    fmt = draw(st.sampled_from(formats))
    if fmt in GGUF_KINDS:
        group = 32
    else:
        bits, group = QUANTIZERS[fmt]
        group = abs(group) if group else 32
    return dict(
        fmt=fmt,
        rows=draw(st.integers(1, 80)),  # across the decode, middle and prefill block sizes
        n=draw(st.integers(1, 72)),  # ragged output tiles
        k=group * draw(st.integers(1, 4 if group < 128 else 2)),
        dtype=DTYPES[draw(st.sampled_from(sorted(DTYPES)))],
        bias=draw(st.booleans()),
        strided=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(gemm_case(tuple(QUANTIZERS)))
def check_quantizer_formats(case):
    check_gemm(device="cpu", **case)


@SETTINGS
@given(gemm_case(GGUF_KINDS))
def check_gguf_formats(case):
    check_gemm(device="cpu", **case)


def check_edges(_=None):
    """No rows; K not a multiple of the group (a shorter last group), odd for 4-bit (a zero nibble
    pads the last byte); a 3-D input."""
    empty = torch.ops.compiled_llm.quant_gemm(torch.empty(0, 64), *gpu_layout(ref.quantize_int8(torch.randn(8, 64)),
                                              torch.device("cpu")), None, 8, 64)
    assert empty.shape == (0, 8)
    for bits, k, group in ((4, 45, 32), (4, 33, 32), (8, 70, 32), (8, 45, None)):
        w = torch.randn(24, k)
        weight = ref.quantize_int4(w, group) if bits == 4 else ref.quantize_int8(w, group)
        x = torch.randn(2, 3, k)
        got = torch.ops.compiled_llm.quant_gemm(x, *gpu_layout(weight, torch.device("cpu")), None, bits,
                                                weight.group_size)
        torch.testing.assert_close(got, x @ ref.dequantize(weight).T, rtol=1e-5, atol=1e-5)


@contextmanager
def forced_path(triton: bool):
    """Layers built inside take the Triton op (True) or the plain torch path (False), on this CPU."""
    import compiled_llm.quantization.weight_only as weight_only

    saved = weight_only.uses_triton_kernel, weight_only.uses_quantized_kernel
    weight_only.uses_triton_kernel = lambda device: triton
    weight_only.uses_quantized_kernel = lambda *args: False  # not the C++ GEMM
    try:
        yield
    finally:
        weight_only.uses_triton_kernel, weight_only.uses_quantized_kernel = saved


def check_layer_and_trace(_=None):
    """The method's GPU path (forced on this CPU): a fused layer's int4 parts laid out for the op,
    its forward equal to the reference, and Dynamo tracing the op as one opaque node."""
    from compiled_llm.models.layers.linear import MergedLinear
    from compiled_llm.quantization.weight_only import WeightOnlyLinearMethod

    g = torch.Generator().manual_seed(0)

    class Config:
        def linear_method(self, prefix):
            return WeightOnlyLinearMethod(4, 32)

    layer = MergedLinear(128, [48, 40], bias=True, quant_config=Config(), prefix="mlp")
    parts = [torch.randn(48, 128, generator=g), torch.randn(40, 128, generator=g)]
    for i, part in enumerate(parts):
        layer.load_checkpoint("weight", part, i)
        layer.load_checkpoint("bias", torch.randn(part.shape[0], generator=g), i)
    with forced_path(triton=True):
        layer.process_weights_after_loading()
    assert layer.triton_kernel and layer.qweight.shape == (88, 64) and layer.qweight.dtype == torch.uint8
    expected_weight = torch.cat([ref.dequantize(ref.quantize_int4(p, 32)) for p in parts])
    x = torch.randn(5, 128, generator=g)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, expected_weight, layer.bias),
                               rtol=1e-4, atol=1e-4)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x[:3]), layer(x[:3]))
    assert seen == ["compiled_llm.quant_gemm"], seen  # one opaque op: no de-quantize, no linear


def check_model_through_inductor(_=None):
    """A small int4 model with every linear on the Triton op (forced on this CPU), compiled at -O1
    (the op opaque inside Inductor's pieces), gives the tokens of the same weights through the
    torch path at -O0 (or each side's in the other's top 5)."""
    import tempfile

    from compiled_llm import LLM, SamplingParams
    from compiled_llm.models.dummy import SMOLLM2_135M, write_dummy_model
    from tests.oracle import check_close, ours_greedy

    shape = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512)
    prompts = [{"prompt_token_ids": [(5 * i + j) % 500 + 3 for j in range(n)]} for i, n in enumerate([3, 20, 9])]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:  # its own compile cache: the key cannot see the forced path
        folder = write_dummy_model(Path(tmp) / "model", {**SMOLLM2_135M, **shape})
        runs = {}
        for name, level, triton in (("torch", 0, False), ("triton", 1, True)):
            with forced_path(triton):
                llm = LLM(folder, load_format="dummy", quantization="int4", quantization_options={"group_size": 32},
                          optimization_level=level, compile_cache=str(Path(tmp) / "cache"), max_model_len=256,
                          max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 24)
            try:
                layer = llm.llm_engine.engine_core.executor.driver.model.model.layers[0].mlp.down_proj
                assert layer.triton_kernel == triton
                runs[name] = ours_greedy(llm.generate(prompts, params, use_tqdm=False))
            finally:
                llm.llm_engine.engine_core.shutdown()
    check_close(runs["triton"], runs["torch"], "Triton op at -O1", "torch at -O0")


def test_nibble_layout():
    """Byte j holds input 2j (low nibble) and 2j + 1 (high); an odd K pads a zero nibble."""
    q = torch.tensor([[1, 2, 3, 4, 5], [15, 0, 0, 15, 7]], dtype=torch.uint8)
    assert pack_nibbles(q).tolist() == [[0x21, 0x43, 0x05], [0x0F, 0xF0, 0x07]]


def test_gpu_layout_keeps_the_format_bytes():
    """Q4_1 stays 0.5 bytes a weight plus its fp16 scale and min per 32; per-channel int8, 1 byte."""
    weight = quantized_weight("Q4_1", 64, 256, 0)
    q, scales, mins = gpu_layout(weight, torch.device("cpu"))
    assert (q.dtype, tuple(q.shape), scales.dtype, mins.dtype) == (torch.uint8, (64, 128), torch.float16,
                                                                   torch.float16)
    assert (q.numel() + 2 * scales.numel() + 2 * mins.numel()) / (64 * 256) == 0.625
    q, scales, mins = gpu_layout(ref.quantize_int8(torch.randn(64, 256)), torch.device("cpu"))
    assert (q.dtype, tuple(scales.shape), mins) == (torch.int8, (64, 1), None)


def test_the_op_has_a_fake_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 3, 256, dtype=torch.bfloat16)
        out = torch.ops.compiled_llm.quant_gemm(x, torch.empty(96, 128, dtype=torch.uint8),
                                                torch.empty(96, 2), torch.empty(96, 2), None, 4, 128)
    assert out.shape == (7, 3, 96) and out.dtype == torch.bfloat16


# (activations, bits, per channel, mins, dot in fp32): bf16/fp16 activations dot in their dtype.
VARIANTS = [("bf16", 4, False, True, False), ("bf16", 8, True, False, False), ("fp16", 8, False, False, False),
            ("fp32", 4, False, True, True), ("fp32", 8, True, False, True)]


@pytest.mark.parametrize("arch", [80, 90], ids=["ampere", "hopper"])
def test_kernel_compiles_for_nvidia_gpus(arch):
    """No GPU needed: Triton's own compiler lowers the kernel for the target (to PTX and, with the
    ptxas it ships, to a cubin), so what the interpreter cannot see (tl.dot's tile shapes and
    dtypes on tensor cores, the nibble interleave's layouts, shared memory) is checked here. Each
    variant at one of the block-size configs, every config used."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import compiled_llm.kernels.triton_quant_gemm as gemm

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces the kernel")
    try:  # the ptxas Triton's wheels ship beside their CUDA backend
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(arch)
    except Exception as e:
        pytest.skip(f"no ptxas for Triton's CUDA backend here: {e}")
    ints = ("M", "N", "K", "group_size", "stride_xm", "stride_xk", "stride_qn", "stride_sn", "stride_ym")
    configs = [tuple(c[1:]) for c in gemm._CONFIGS]
    for i, (act, bits, per_channel, mins, dot_fp32) in enumerate(VARIANTS):
        block_m, block_n, block_k, num_warps, num_stages = configs[i % len(configs)]
        constants = dict(BITS=bits, PER_CHANNEL=per_channel, HAS_MINS=mins, HAS_BIAS=True, DOT_FP32=dot_fp32,
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
        signature = {"x_ptr": f"*{act}", "q_ptr": "*i8" if bits == 8 else "*u8", "scales_ptr": "*fp16",
                     "mins_ptr": "*fp16", "bias_ptr": f"*{act}", "y_ptr": f"*{act}", **dict.fromkeys(ints, "i32"),
                     **dict.fromkeys(constants, "constexpr")}
        source = ASTSource(fn=gemm._quant_gemm_kernel, signature=signature, constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        assert compiled.asm["cubin"] and compiled.metadata.shared <= 96 * 1024  # fits every GPU since Ampere


INTERPRETED = {"quantizer-formats": check_quantizer_formats, "gguf-formats": check_gguf_formats,
               "edges": check_edges, "layer-and-trace": check_layer_and_trace,
               "model-through-inductor": check_model_through_inductor}


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str | None]:
    return interpret(__file__)


@pytest.mark.parametrize("name", list(INTERPRETED))
def test_interpreted_kernel_matches_reference(interpreted_results, name):
    assert name in interpreted_results, f"case {name} did not run"
    assert interpreted_results[name] is None, interpreted_results[name]


# ---- on a GPU: compiled kernels at model shapes ------------------------------------------------
# SmolLM2-135M (K 576 / 1536, N 576 / 1536 / 49152 head) and Llama-8B-like (K 4096, N 6144) shapes,
# decode (1, 8 rows) and prefill (256, 1000 rows).
GPU_SHAPES = [(1, 1536, 576), (8, 576, 1536), (256, 1536, 576), (1000, 6144, 4096), (3, 49152, 576)]


# Every format in bfloat16 (a GPU model's dtype), two in fp16 and fp32 too: each (format, dtype,
# block size, bias) is a Triton compilation of its own, a second or so each.
GPU_CASES = [(fmt, "bf16") for fmt in (*QUANTIZERS, *GGUF_KINDS)] + [
    (fmt, dtype) for fmt in ("int8", "Q4_1") for dtype in ("fp16", "fp32")]


@pytest.mark.cuda
@pytest.mark.parametrize(("fmt", "dtype"), GPU_CASES)
def test_gpu_gemm_matches_reference(fmt, dtype):
    for i, (rows, n, k) in enumerate(GPU_SHAPES):
        if k % 128 and fmt.endswith("g128"):
            k = 640 if k == 576 else k
        check_gemm(fmt, rows, n, k, DTYPES[dtype], bias=i % 2 == 0, strided=i == 1, device="cuda", seed=i)


@pytest.mark.cuda
def test_gpu_gemm_replays_in_a_cuda_graph():
    """Captured once, the op follows new activations in the same buffer on every replay."""
    weight = quantized_weight("Q4_1", 576, 1536, 0)
    q, scales, mins = gpu_layout(weight, torch.device("cuda"))
    x = torch.randn(8, 1536, device="cuda", dtype=torch.bfloat16)

    def step():
        return torch.ops.compiled_llm.quant_gemm(x, q, scales, mins, None, 4, 32)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    expected = x.double() @ ref.dequantize(weight).double().cuda().T
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["int8", "int4", "gguf-q8_0"])
def test_gpu_weight_only_layers_call_the_triton_op(method):
    """On a GPU a quantized layer keeps the packed layout and computes through the Triton op."""
    from compiled_llm.models.layers.linear import Linear
    from compiled_llm.quantization.weight_only import WeightOnlyLinearMethod

    bits, group = {"int8": (8, None), "int4": (4, 128), "gguf-q8_0": (8, 32)}[method]

    class Config:
        def linear_method(self, prefix):
            return WeightOnlyLinearMethod(bits, group)

    with torch.device("cuda"):
        layer = Linear(576, 1536, bias=True, quant_config=Config(), prefix="mlp")
    w = torch.randn(1536, 576) * 0.05
    layer.load_checkpoint("weight", w, None)
    layer.load_checkpoint("bias", torch.randn(1536), None)
    layer.process_weights_after_loading()
    assert layer.triton_kernel and layer.qweight.is_cuda
    x = torch.randn(4, 576, device="cuda")
    expected = torch.nn.functional.linear(x, ref.dequantize(
        ref.quantize_int8(w, group) if bits == 8 else ref.quantize_int4(w, group)).cuda(), layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-3, atol=1e-3)


if __name__ == "__main__":
    print_results(INTERPRETED)
