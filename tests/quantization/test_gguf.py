"""`gguf`: the bundled model served from its shipped Q4_1 file, blocks kept packed.

One engine (compiled, started strictly warm from a `precompile` of the served default, which is the
file) serves the module's generation tests; the damaged-file tests fail before any engine is built.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig

from compiled_llm import LLM, SamplingParams
from compiled_llm.bundled_model import bundled_gguf_path
from compiled_llm.gguf_file import GGUFFileError, metadata_folder, open_gguf
from compiled_llm.kernels.quantized_reference import QuantizedWeight, dequantize
from compiled_llm.models.gguf_loader import iterate_gguf, rotary_row_order
from compiled_llm.quantization.weight_only import quantizes_activations
from tests.models.test_hf_parity import PROMPTS
from tests.oracle import check_close, ours_greedy

ENGINE = dict(max_model_len=1024, kv_cache_memory_bytes=128 << 20)


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return str(bundled_gguf_path())


@pytest.fixture(scope="module")
def precompiled(precompiled_default) -> tuple[Path, dict]:
    """`compiled-llm precompile` of the served default, which is the GGUF file, into a fresh compile
    cache (shared with tests/compilation/test_real_model.py; `max_model_len` is not in the key)."""
    return precompiled_default


@pytest.fixture(scope="module")
def llm(gguf_path, precompiled) -> LLM:
    """The module's one engine: the GGUF file at -O1, started from the precompiled cache."""
    cache, _ = precompiled
    return LLM(gguf_path, optimization_level=1, compile_cache=str(cache), require_cache_hit=True, **ENGINE)


def test_blocks_dequantize_as_the_gguf_package_does(gguf_path):
    reader = open_gguf(gguf_path)
    reference = {t.name: t for t in reader.tensors}
    wanted = {"model.embed_tokens.weight": "token_embd.weight",  # Q8_0
              "model.layers.3.mlp.down_proj.weight": "blk.3.ffn_down.weight",  # Q4_1
              "model.layers.7.self_attn.q_proj.weight": "blk.7.attn_q.weight",  # Q4_1, rows un-permuted
              "model.layers.7.self_attn.k_proj.weight": "blk.7.attn_k.weight",
              "model.norm.weight": "output_norm.weight"}  # F32
    hf_config = AutoConfig.from_pretrained(metadata_folder(gguf_path))
    seen = 0
    for name, loaded in iterate_gguf(gguf_path, hf_config):
        if name not in wanted:
            continue
        tensor = reference[wanted[name]]
        expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
        if "attn_q" in tensor.name or "attn_k" in tensor.name:
            heads = hf_config.num_attention_heads if "attn_q" in tensor.name else hf_config.num_key_value_heads
            expected = expected[torch.from_numpy(rotary_row_order(expected.shape[0], heads))]
        kind = tensor.tensor_type.name
        if kind in ("Q8_0", "Q4_1"):
            assert isinstance(loaded, QuantizedWeight) and loaded.bits == (8 if kind == "Q8_0" else 4)
            loaded = dequantize(loaded)
        assert torch.equal(loaded, expected), name
        seen += 1
    assert seen == len(wanted)


def test_served_from_its_q4_1_file_matches_the_float32_conversion(llm, real_model_path):
    """Q4_1 de-quantizes exactly into the float32 conversion's weights: where the kernels take float
    activations only the order of the sums differs, so greedy tokens agree, or where they part each
    is in the other's top 5. Where the Q8_0 head's kernel quantizes its activations to int8 too
    (AVX512-VNNI, as llama.cpp does), texts part sooner (perplexity +0.3%, benchmarks/perplexity.py):
    the top-5 rule still holds where they part."""
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5, ignore_eos=True)
    ours = llm.generate(PROMPTS, params, use_tqdm=False)
    float32 = LLM(real_model_path, optimization_level=0, **ENGINE)
    reference = float32.generate(PROMPTS, params, use_tqdm=False)
    del float32
    assert [o.prompt_token_ids for o in ours] == [r.prompt_token_ids for r in reference]  # the same tokenizer
    exact = check_close(ours_greedy(ours), ours_greedy(reference), "gguf", "float32")
    if not quantizes_activations(8):
        assert exact >= len(PROMPTS) // 2, f"only {exact} of {len(PROMPTS)} prompts matched exactly"


def test_precompile_then_strict_warm_start_compiles_nothing(llm, precompiled):
    _, cold = precompiled
    assert cold["inductor_compilations"] > 0
    assert llm.llm_engine.engine_core.executor.driver.compiled_forward.report.inductor_compilations == 0


def test_chat_template_and_eos_come_from_the_file(llm):
    messages = [{"role": "user", "content": "Say hi."}]
    text = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text  # ended by <|im_end|>, the file's EOS


def _damaged(tmp_path: Path, source: str, name: str, change) -> str:
    data = bytearray(Path(source).read_bytes())
    data = change(data)
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return str(path)


def _type_offset(path: str, tensor_name: str) -> int:
    """Where the type id of `tensor_name` sits in the file's tensor table."""
    field = next(t.field for t in gguf.GGUFReader(path).tensors if t.name == tensor_name)
    return field.offset + sum(int(part.nbytes) for part in field.parts[:4])


def test_a_truncated_file_is_one_error_naming_the_tensor(tmp_path, gguf_path):
    path = _damaged(tmp_path, gguf_path, "truncated.gguf", lambda d: d[: len(d) // 2])
    with pytest.raises(GGUFFileError, match=r"truncated\.gguf: tensor 'blk\.\d+\.\w+\.weight' \(Q4_1, .*truncated"):
        LLM(path, optimization_level=0, **ENGINE)


def test_a_flipped_header_byte_is_one_error_naming_the_tensor(tmp_path, gguf_path):
    offset = _type_offset(gguf_path, "blk.0.attn_q.weight")

    def flip(data: bytearray) -> bytearray:
        data[offset] ^= 0x40
        return data

    path = _damaged(tmp_path, gguf_path, "flipped.gguf", flip)
    with pytest.raises(GGUFFileError, match=r"tensor 'blk\.0\.attn_q\.weight' has unknown type id 67"):
        LLM(path, optimization_level=0, **ENGINE)


def _write_layers(path: Path, source: str, layers: int, tensor_data) -> str:
    """A GGUF file of the shipped file's metadata and its first `layers` layers, each tensor as
    `tensor_data(tensor)` gives it: (array, raw_dtype or None for the array's own float type)."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = layers if key == "llama.block_count" else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        data, raw_dtype = tensor_data(tensor)
        writer.add_tensor(tensor.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_an_unsupported_tensor_type_is_one_error_naming_it(tmp_path, gguf_path):
    """A one-layer model written with the gguf package, its up projection in Q5_0."""

    def q5_0_up(tensor):
        if tensor.name == "blk.0.ffn_up.weight":  # 1536 x 576 in blocks of 32 weights, 22 bytes each
            return np.zeros((1536, 576 // 32 * 22), np.uint8), gguf.GGMLQuantizationType.Q5_0
        return np.array(tensor.data), tensor.tensor_type

    path = _write_layers(tmp_path / "one-layer-q5_0.gguf", gguf_path, 1, q5_0_up)
    try:
        with pytest.raises(GGUFFileError, match=r"tensor 'blk\.0\.ffn_up\.weight' is Q5_0, which this engine can"):
            LLM(path, optimization_level=0, **ENGINE)
    finally:  # its config and tokenizer were read: leave no folder for a file that is gone
        shutil.rmtree(metadata_folder(path), ignore_errors=True)


def _two_layer_float_file(tmp_path: Path, source: str, dtype: np.dtype) -> str:
    """The shipped file's first two layers with every quantized tensor de-quantized and rounded to
    float16, written as `dtype` (F16 or F32: the very same values; norms stay F32)."""

    def as_float(tensor):
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if tensor.tensor_type.name != "F32":
            values = values.astype(np.float16).astype(dtype)
        return np.ascontiguousarray(values), None

    kind = "F16" if dtype == np.float16 else "F32"
    return _write_layers(tmp_path / f"two-layer-{kind}.gguf", source, 2, as_float)


def test_an_f16_file_keeps_two_bytes_a_weight_and_answers_as_its_f32_twin(tmp_path, gguf_path):
    """F16 tensors under float32 activations are stored in 16 bits (the half-storage GEMM widens
    them in registers) rather than expanded; the same values written as F32 give the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    runs, paths = {}, {}
    try:
        for dtype in (np.float16, np.float32):
            paths[dtype] = _two_layer_float_file(tmp_path, gguf_path, dtype)
            llm = LLM(paths[dtype], optimization_level=0, **ENGINE)
            model = llm.llm_engine.engine_core.executor.driver.model
            qkv = model.model.layers[0].self_attn.qkv_proj
            if dtype == np.float16:
                assert getattr(qkv, "weight", None) is None or qkv.weight.dtype == torch.float16
                kept = (getattr(qkv, "packed_weight", None), getattr(qkv, "weight", None))
                packed = [b for b in kept if b is not None]
                assert packed and all(b.dtype == torch.float16 for b in packed)
                assert model.lm_head.packed_weight is not None and model.lm_head.packed_weight.dtype == torch.float16
            else:
                assert qkv.weight.dtype == torch.float32
            runs[dtype] = ours_greedy(llm.generate(PROMPTS[:4], params, use_tqdm=False))
            del llm
        assert check_close(runs[np.float16], runs[np.float32], "F16", "F32") >= 3
    finally:
        for path in paths.values():
            shutil.rmtree(metadata_folder(path), ignore_errors=True)


def test_a_warm_llm_reads_its_packed_weights_before_its_tokenizer_and_uses_them(gguf_path, precompiled,
                                                                                monkeypatch):
    """`LLM()` starts reading the entry's packed weights as soon as its settings are known, so the
    read overlaps the tokenizer's load and the engine's imports; the load then takes those bytes,
    and none stay held."""
    import compiled_llm.compilation.compile_cache as compile_cache
    import compiled_llm.engine.llm_engine as llm_engine
    import compiled_llm.models.loader as loader

    events: list[str] = []

    def spy(module, name, event):  # the real function, and what its call was, in order
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            events.append(event(out))
            return out
        monkeypatch.setattr(module, name, wrapped)

    spy(loader, "read_ahead", lambda _: "read ahead")
    spy(llm_engine, "get_tokenizer", lambda _: "tokenizer")
    spy(compile_cache, "take_read_ahead", lambda out: "taken" if out is not None else "none to take")
    cache, _ = precompiled
    LLM(gguf_path, optimization_level=1, compile_cache=str(cache), require_cache_hit=True, **ENGINE)
    assert events[:2] == ["read ahead", "tokenizer"] and "taken" in events, events
    assert compile_cache._read_ahead == {}
