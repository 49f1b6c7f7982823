"""LoRA adapters through the offline API (`LLM(enable_lora=True).generate(..., lora_request=...)`)
on the tiny Llama, compiled (-O1): greedy tokens equal to HF transformers running PEFT's merged
adapter; several adapters and the base model mixed in one batch equal to each run alone; the
prefix cache never crossing adapters; bad adapters refused with a clear error while the engine
keeps serving; every KV block free at the end."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.lora.request import LoRARequest
from tests.lora.adapters import ALL_TARGETS, make_adapter
from tests.oracle import check_close, hf_greedy, ours_greedy

PROMPTS = ["The capital of France is", "Once upon a time, there", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Three adapters: every projection at rank 8; q and v only at rank 4; the MLP with rsLoRA."""
    root = tmp_path_factory.mktemp("adapters")
    specs = [("all", 8, ALL_TARGETS, {}), ("qv", 4, ["q_proj", "v_proj"], {}),
             ("mlp", 8, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True})]
    made = {}
    for i, (name, rank, targets, options) in enumerate(specs, start=1):
        path, merged = make_adapter(tiny_llama, root / name, rank, targets, seed=i, **options)
        made[name] = (LoRARequest(name, i, path), merged)
    return made


@pytest.fixture(scope="module")
def llm(tiny_llama, tmp_path_factory):
    return LLM(tiny_llama, enable_lora=True, max_loras=3, max_lora_rank=8, optimization_level=1,
               compile_cache=str(tmp_path_factory.mktemp("cc")), kv_cache_memory_bytes=16 << 20, max_model_len=512)


def ids_of(llm, prompts):
    tokenizer = llm.get_tokenizer()
    return [tokenizer(p)["input_ids"] for p in prompts]


def tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_equals_hf_with_the_merged_adapter(llm, adapters, tiny_llama):
    ids = ids_of(llm, PROMPTS)
    for name, (request, merged) in [("base", (None, tiny_llama)), *adapters.items()]:
        ours = ours_greedy(llm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False))
        theirs = hf_greedy(merged, ids, GREEDY.max_tokens)
        assert check_close(ours, theirs) >= len(PROMPTS) - 1, name
    base = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with_all = tokens(llm.generate(PROMPTS, GREEDY, lora_request=adapters["all"][0], use_tqdm=False))
    assert base != with_all, "the adapter changed nothing: its update was dropped"


def test_a_mixed_batch_equals_each_run_alone(llm, adapters):
    requests = [None, *(request for request, _ in adapters.values())]
    alone = {i: tokens(llm.generate(PROMPTS, GREEDY, lora_request=r, use_tqdm=False)) for i, r in enumerate(requests)}
    # Every prompt under every adapter and the base model, in one call: one batch, mixed in every step.
    prompts = [p for p in PROMPTS for _ in requests]
    mixed = tokens(llm.generate(prompts, GREEDY, lora_request=requests * len(PROMPTS), use_tqdm=False))
    for k, got in enumerate(mixed):
        assert got == alone[k % len(requests)][k // len(requests)], f"prompt {k // len(requests)}, adapter {k % 4}"


def test_the_prefix_cache_never_crosses_adapters(llm, adapters):
    prompt = "In a hole in the ground there lived a hobbit. " * 6  # several full blocks
    request = adapters["all"][0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = llm.generate([prompt], params, use_tqdm=False)[0]
    first = llm.generate([prompt], params, lora_request=request, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0, "blocks computed without the adapter were reused under it"
    again = llm.generate([prompt], params, lora_request=request, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16 and tokens([again]) == tokens([first])
    other = llm.generate([prompt], params, lora_request=adapters["qv"][0], use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    back = llm.generate([prompt], params, use_tqdm=False)[0]
    assert back.num_cached_tokens >= 16 and tokens([back]) == tokens([base])


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(llm, adapters, tiny_llama, tmp_path):
    too_big, _ = make_adapter(tiny_llama, tmp_path / "r16", 16, ["q_proj"], seed=7, merged=False)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    config = Path(adapters["qv"][0].lora_path) / "adapter_config.json"
    (damaged / "adapter_config.json").write_text(config.read_text())
    (damaged / "adapter_model.safetensors").write_bytes(b"not safetensors")
    cases = [(LoRARequest("big", 10, too_big), "rank 16 is above max_lora_rank 8"),
             (LoRARequest("damaged", 11, str(damaged)), "damaged or not safetensors"),
             (LoRARequest("missing", 12, str(tmp_path / "missing")), "not a folder")]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS, GREEDY, lora_request=[None, request, None], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests(), "a refused batch must queue nothing"
    good = adapters["qv"][0]
    assert len(llm.generate(PROMPTS, GREEDY, lora_request=good, use_tqdm=False)) == len(PROMPTS)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(PROMPTS, GREEDY, lora_request=[good], use_tqdm=False)


def test_every_kv_block_is_free_at_the_end(llm):
    pool = llm.llm_engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


@pytest.fixture(scope="module")
def one_slot_llm(tiny_llama):
    """One slot and one adapter in host memory: adapters take turns, and are read again once evicted."""
    return LLM(tiny_llama, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1, optimization_level=0,
               kv_cache_memory_bytes=16 << 20, max_model_len=512)


def test_more_adapters_than_slots_wait_their_turn(one_slot_llm, adapters):
    """max_loras=1: the three adapters and the base model in one call; each adapter's requests
    run while the others wait (base-model requests run beside any of them), outputs unchanged."""
    llm = one_slot_llm
    requests = [None, *(request for request, _ in adapters.values())]
    alone = {i: tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=r, use_tqdm=False))
             for i, r in enumerate(requests)}
    prompts = [p for p in PROMPTS[:2] for _ in requests]
    mixed = tokens(llm.generate(prompts, GREEDY, lora_request=requests * 2, use_tqdm=False))
    assert mixed == [alone[k % 4][k // 4] for k in range(len(prompts))]
    manager = llm.llm_engine.engine_core.executor.driver.lora
    assert manager.slots.loaded and len(manager.slots.loaded) == 1
    pool = llm.llm_engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_a_folder_gone_after_its_check_fails_its_own_request_not_the_engine(one_slot_llm, adapters, tmp_path):
    """The frontend reads an adapter's folder once; the engine reads it again when a request names
    it and it is not in host memory (max_cpu_loras=1 evicted it). A folder gone by then refuses
    that request, and nothing else: the engine keeps serving. A request accepted before its folder
    went is served from host memory (the engine pins the adapters of its unfinished requests)."""
    llm, engine = one_slot_llm, one_slot_llm.llm_engine
    qv = adapters["qv"][0].lora_path
    vanishing = LoRARequest("vanishing", 20, str(shutil.copytree(qv, tmp_path / "vanishing")))
    expected = tokens(llm.generate(PROMPTS[:1], GREEDY, lora_request=vanishing, use_tqdm=False))
    llm.generate(PROMPTS[:1], GREEDY, lora_request=adapters["all"][0], use_tqdm=False)  # evicts it
    shutil.rmtree(vanishing.lora_path)
    with pytest.raises(ValueError, match="not a folder"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[None, vanishing], use_tqdm=False)
    assert not engine.has_unfinished_requests(), "a refused batch must queue nothing"
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)

    shutil.copytree(qv, vanishing.lora_path)
    engine.add_processed(*engine.process("pinned", PROMPTS[0], GREEDY, lora_request=vanishing))
    shutil.rmtree(vanishing.lora_path)  # before the request's first step
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    assert tokens(finished) == expected
    pool = engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_an_engine_without_lora_refuses_an_adapter(tiny_llama, adapters):
    llm = LLM(tiny_llama, optimization_level=0, kv_cache_memory_bytes=4 << 20, max_model_len=256)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=adapters["qv"][0], use_tqdm=False)


def test_a_warm_start_serves_other_adapters_without_compiling(llm, adapters, tiny_llama):
    """Adapters are data: a second engine with the same LoRA settings loads every piece from the
    first one's compile cache entry (zero Inductor runs) and serves an adapter the first never saw
    loaded in the same slot order, with the same tokens."""
    cache = llm.llm_engine.config.compilation_config.cache_dir
    warm = LLM(tiny_llama, enable_lora=True, max_loras=3, max_lora_rank=8, optimization_level=1, compile_cache=cache,
               kv_cache_memory_bytes=16 << 20, max_model_len=512, require_cache_hit=True)
    report = warm.llm_engine.engine_core.executor.driver.compiled_forward.report
    assert report.inductor_compilations == 0 and report.artifacts_loaded > 0
    request = adapters["mlp"][0]
    assert tokens(warm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False)) == \
        tokens(llm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False))


def test_lora_dtype_picks_the_slots_dtype_and_refuses_others():
    """auto: float16 slots under the C++ CPU kernels (float32 activations), else the activations'
    dtype (vLLM's auto); an explicit dtype is kept; anything else is refused by name."""
    import torch

    from compiled_llm.config import LoRAConfig
    from compiled_llm.models.layers.lora import lora_stack_dtype

    assert lora_stack_dtype("auto", torch.float32, cpu_kernels=True) == torch.float16
    assert lora_stack_dtype("auto", torch.float32, cpu_kernels=False) == torch.float32
    assert lora_stack_dtype("auto", torch.bfloat16, cpu_kernels=False) == torch.bfloat16
    assert lora_stack_dtype("float32", torch.float32, cpu_kernels=True) == torch.float32
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        LoRAConfig(lora_dtype="int8")
