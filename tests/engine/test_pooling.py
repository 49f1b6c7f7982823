"""The pooling runner (`runner="pooling"`, an embed-converted decoder): its vectors equal HF
transformers' final hidden states pooled the same way, whether a prompt is computed in one step or
in chunks, from the prefix cache or not, alone or in a batch; the bundled model's compiled pieces
are the generate runner's (same compile cache entry); and every misuse is a clear error."""

from __future__ import annotations

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.pooling_params import PoolingParams
from compiled_llm.worker.cache_factors import engine_cache_factors

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"]
LONG = " ".join(f"word{i}" for i in range(60))  # ~180 tokens: many blocks, many chunks
TINY = dict(optimization_level=0, max_model_len=512, kv_cache_memory_bytes=16 << 20)


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a).float(), torch.as_tensor(b).float(), dim=0))


def hf_hidden(folder: str, token_ids: list[list[int]]) -> list[torch.Tensor]:
    """HF's final hidden states (after the last norm) of each prompt, [tokens, hidden]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.model(torch.tensor([ids])).last_hidden_state[0] for ids in token_ids]


def hf_pooled(folder: str, token_ids: list[list[int]], kind: str) -> list[torch.Tensor]:
    """HF's final hidden states of each prompt, pooled as `kind`."""
    return [{"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind] for h in hf_hidden(folder, token_ids)]


def assert_free(llm: LLM) -> None:
    pool = llm.llm_engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "KV blocks still held after every request finished"


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_tiny_model_matches_hf_chunked_batched_and_cached(tiny_llama, kind):
    llm = LLM(tiny_llama, runner="pooling", pooler_config={"pooling_type": kind, "normalize": False}, **TINY)
    chunked = LLM(tiny_llama, runner="pooling", pooler_config={"pooling_type": kind, "normalize": False},
                  max_num_batched_tokens=16, max_num_seqs=4, **TINY)
    # Prefix caching only where every needed position is still computed (LAST): MEAN and CLS turn it off.
    assert llm.llm_engine.config.cache_config.enable_prefix_caching is (kind == "LAST")
    prompts = [*TEXTS, LONG]
    token_ids = [llm.get_tokenizer()(p)["input_ids"] for p in prompts]
    reference = hf_pooled(tiny_llama, token_ids, kind)

    batched = llm.encode(prompts, use_tqdm=False)
    for out, ref, ids in zip(batched, reference, token_ids):
        assert out.finished and out.prompt_token_ids == ids
        assert out.outputs.data.shape == (64,)
        assert cosine(out.outputs.data, ref) >= 0.999
        torch.testing.assert_close(out.outputs.data, ref, atol=1e-4, rtol=1e-4)
    one_by_one = [llm.encode(p, use_tqdm=False)[0] for p in prompts]
    for a, b in zip(batched, one_by_one):
        torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=1e-5, rtol=1e-5)
    # The long prompt in 16-token chunks, beside the others.
    for a, b in zip(chunked.encode(prompts, use_tqdm=False), batched):
        torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=1e-5, rtol=1e-5)
    again = llm.encode(LONG, use_tqdm=False)[0]
    assert (again.num_cached_tokens > 0) is (kind == "LAST")
    torch.testing.assert_close(again.outputs.data, batched[-1].outputs.data, atol=1e-5, rtol=1e-5)
    assert_free(llm)
    assert_free(chunked)


def test_token_embed_gives_every_token_its_embedding(tiny_llama):
    """vLLM's per-token task: one normalised embedding per prompt token, equal to HF's final hidden
    states, in 16-token chunks too; it never reads the prefix cache (a cached block's positions
    would be missing), while the same engine's LAST embeddings still do."""
    llm = LLM(tiny_llama, runner="pooling", max_num_batched_tokens=16, max_num_seqs=4, **TINY)
    assert llm.llm_engine.config.cache_config.enable_prefix_caching
    token_ids = [llm.get_tokenizer()(p)["input_ids"] for p in [TEXTS[0], LONG]]
    llm.embed([{"prompt_token_ids": ids} for ids in token_ids], use_tqdm=False)  # fills the prefix cache
    outs = llm.encode([{"prompt_token_ids": ids} for ids in token_ids], pooling_task="token_embed", use_tqdm=False)
    for out, ids, ref in zip(outs, token_ids, hf_hidden(tiny_llama, token_ids)):
        assert out.outputs.data.shape == (len(ids), 64) and out.num_cached_tokens == 0
        torch.testing.assert_close(out.outputs.data, torch.nn.functional.normalize(ref, dim=-1), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="dimensions applies to embeddings"):
        llm.encode(TEXTS[0], PoolingParams(task="token_embed", dimensions=8), use_tqdm=False)
    assert_free(llm)


def test_embed_score_truncation_and_errors(tiny_llama):
    llm = LLM(tiny_llama, runner="pooling", convert="embed", **TINY)  # default pooler: LAST, normalized
    embeddings = llm.embed(TEXTS, use_tqdm=False)
    raw = llm.encode(TEXTS, use_tqdm=False)  # task encode: the pooled state as it is
    for e, r in zip(embeddings, raw):
        vector = torch.tensor(e.outputs.embedding)
        assert abs(float(vector.norm()) - 1.0) < 1e-5
        torch.testing.assert_close(vector, torch.nn.functional.normalize(r.outputs.data, dim=0))
    scores = llm.score(TEXTS[0], TEXTS, use_tqdm=False)
    assert [round(s.outputs.score, 5) for s in scores] == [
        round(cosine(embeddings[0].outputs.embedding, e.outputs.embedding), 5) for e in embeddings]
    assert abs(scores[0].outputs.score - 1.0) < 1e-5
    pairwise = llm.score(TEXTS, TEXTS[::-1], use_tqdm=False)
    assert abs(pairwise[0].outputs.score - scores[2].outputs.score) < 1e-5
    ids = llm.get_tokenizer()(LONG)["input_ids"]
    cut = llm.embed(LONG, truncate_prompt_tokens=7, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-7:]
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding),
                               torch.tensor(llm.embed([ids[-7:]], use_tqdm=False)[0].outputs.embedding))

    with pytest.raises(ValueError, match="pooling runner"):
        llm.generate("Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed("Hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="classification head"):
        llm.classify("Hello")
    with pytest.raises(ValueError, match="give one text_1"):
        llm.score(TEXTS[:2], TEXTS, use_tqdm=False)
    with pytest.raises(ValueError, match="out of (the )?vocabulary"):
        llm.embed([[10**7]], use_tqdm=False)
    embeddings_after = llm.embed(TEXTS[:1], use_tqdm=False)  # still serving
    torch.testing.assert_close(torch.tensor(embeddings_after[0].outputs.embedding),
                               torch.tensor(embeddings[0].outputs.embedding), atol=1e-5, rtol=1e-5)
    assert_free(llm)


def test_a_generating_engine_refuses_pooling_and_bad_settings_are_named(tiny_llama):
    llm = LLM(tiny_llama, **TINY)
    with pytest.raises(ValueError, match="--runner pooling"):
        llm.embed("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type"):
        EngineArgs(tiny_llama, runner="pooling", pooler_config={"pooling_type": "MAX"}).create_engine_config()
    with pytest.raises(ValueError, match="classification head"):
        EngineArgs(tiny_llama, convert="classify").create_engine_config()
    with pytest.raises(ValueError, match="--convert embed"):
        EngineArgs(tiny_llama, runner="pooling", convert="none").create_engine_config()
    with pytest.raises(ValueError, match="--runner pooling"):
        EngineArgs(tiny_llama, pooler_config={"pooling_type": "MEAN"}).create_engine_config()


def test_matryoshka_dimensions(tiny_llama, tmp_path):
    import json
    import shutil

    folder = tmp_path / "matryoshka"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(folder), runner="pooling", **TINY)
    full = torch.tensor(llm.encode("Hello there", use_tqdm=False)[0].outputs.data)
    short = llm.embed("Hello there", pooling_params=PoolingParams(dimensions=16), use_tqdm=False)[0]
    assert len(short.outputs.embedding) == 16
    torch.testing.assert_close(torch.tensor(short.outputs.embedding), torch.nn.functional.normalize(full[:16], dim=0))
    with pytest.raises(ValueError, match=r"\[16, 32\]"):
        llm.embed("Hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)


@pytest.mark.slow
def test_bundled_model_reuses_the_generate_runners_compiled_pieces(real_model_path, warm_compile_cache):
    """Pooling reads the hidden states the compiled graph returns already: the same cache entry
    (a warm start, `require_cache_hit`), and vectors equal to HF's."""
    generate = EngineArgs(real_model_path).create_engine_config()
    pooling = EngineArgs(real_model_path, runner="pooling").create_engine_config()
    assert engine_cache_factors(generate, 0) == engine_cache_factors(pooling, 0)
    llm = LLM(real_model_path, runner="pooling", require_cache_hit=True, max_model_len=1024,
              kv_cache_memory_bytes=64 << 20)
    outputs = llm.encode([*TEXTS, LONG], use_tqdm=False)
    reference = hf_pooled(real_model_path, [o.prompt_token_ids for o in outputs], "LAST")
    for out, ref in zip(outputs, reference):
        assert cosine(out.outputs.data, ref) >= 0.999
    embedded = llm.embed(TEXTS, use_tqdm=False)
    for e, ref in zip(embedded, reference):
        assert cosine(e.outputs.embedding, ref) >= 0.999
    assert_free(llm)
