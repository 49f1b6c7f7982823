"""The pooling APIs against a real `compiled-llm serve --runner pooling --convert embed` (a tiny
random model that allows Matryoshka dimensions 16 and 32), with the official `openai` client where
it has a method: embeddings equal to HF's final hidden states pooled (LAST, normalised), base64
decoding to the same floats, `dimensions`, chat-style input, vLLM's /pooling, /score and /rerank
consistent with the embeddings, and the clear errors (generating routes on this server, pooling
routes on a generating one)."""

from __future__ import annotations

import base64
import json
import shutil
import sys

import httpx
import numpy as np
import pytest
import torch
from remote_server import RemoteServer

openai = pytest.importorskip("openai")

TIMEOUT = 300
TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Bonjour le monde"]


@pytest.fixture(scope="module")
def matryoshka_model(tiny_llama, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("matryoshka") / "model"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    return str(folder)


@pytest.fixture(scope="module")
def server(matryoshka_model):
    server = RemoteServer([matryoshka_model, "--runner", "pooling", "--convert", "embed", "-O0", "--max-model-len",
                           "512", "--kv-cache-memory-bytes", str(32 << 20), "--served-model-name", "embedder"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=TIMEOUT)


def cosine(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def hf_embeddings(matryoshka_model, client):
    """HF's last-token final hidden state of each text, normalised (the server's token ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(matryoshka_model)
    model = AutoModelForCausalLM.from_pretrained(matryoshka_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.nn.functional.normalize(
            model.model(torch.tensor([tokenizer(t)["input_ids"]])).last_hidden_state[0, -1], dim=0).numpy()
            for t in TEXTS]


def test_embeddings_match_hf_in_every_input_form(client, server, hf_embeddings):
    response = client.embeddings.create(model="embedder", input=TEXTS)
    assert response.object == "list" and response.model == "embedder"
    assert [d.index for d in response.data] == [0, 1, 2]
    vectors = [np.array(d.embedding) for d in response.data]
    for vector, reference in zip(vectors, hf_embeddings):
        assert vector.shape == (64,)
        assert cosine(vector, reference) >= 0.999
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": t}, timeout=TIMEOUT).json()["tokens"] for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(i) for i in ids)
    one = client.embeddings.create(model="embedder", input=TEXTS[0])
    from_ids = client.embeddings.create(model="embedder", input=ids[1])
    from_id_lists = client.embeddings.create(model="embedder", input=ids)
    np.testing.assert_allclose(one.data[0].embedding, vectors[0], atol=1e-5)
    np.testing.assert_allclose(from_ids.data[0].embedding, vectors[1], atol=1e-5)
    for d, vector in zip(from_id_lists.data, vectors):
        np.testing.assert_allclose(d.embedding, vector, atol=1e-5)


def test_base64_decodes_to_the_same_floats(client, server):
    # One input a request: each runs alone, so the two requests compute bit-identical vectors (a
    # batch's prompts may be split over steps differently from one request to the next).
    for text in TEXTS:
        floats = post(server, "/v1/embeddings", {"input": text, "encoding_format": "float"}).json()
        raw = post(server, "/v1/embeddings", {"input": text, "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))
        # The openai client asks for base64 by itself when no format is given, and decodes it.
        default = client.embeddings.create(model="embedder", input=text)
        np.testing.assert_array_equal(np.array(default.data[0].embedding, dtype=np.float32), decoded)


def test_dimensions_truncation_and_chat_input(client, server):
    full = np.array(client.embeddings.create(model="embedder", input=TEXTS[0], encoding_format="float")
                    .data[0].embedding)
    pooled = np.array(post(server, "/pooling", {"input": TEXTS[0]}).json()["data"][0]["data"])
    np.testing.assert_allclose(full, pooled / np.linalg.norm(pooled), atol=1e-5)
    short = np.array(client.embeddings.create(model="embedder", input=TEXTS[0], dimensions=16).data[0].embedding)
    assert short.shape == (16,)
    np.testing.assert_allclose(short, pooled[:16] / np.linalg.norm(pooled[:16]), atol=1e-5)
    with pytest.raises(openai.BadRequestError, match=r"\[16, 32\]"):
        client.embeddings.create(model="embedder", input=TEXTS[0], dimensions=8)
    ids = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[2]}, timeout=TIMEOUT).json()["tokens"]
    cut = client.embeddings.create(model="embedder", input=TEXTS[2], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    np.testing.assert_allclose(cut.data[0].embedding, client.embeddings.create(
        model="embedder", input=ids[-3:], encoding_format="float").data[0].embedding, atol=1e-5)
    messages = [{"role": "user", "content": "Hello"}]
    chat = post(server, "/v1/embeddings", {"messages": messages, "encoding_format": "float"}).json()
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False},
                          timeout=TIMEOUT).json()["tokens"]
    assert chat["usage"]["prompt_tokens"] == len(rendered)
    np.testing.assert_allclose(chat["data"][0]["embedding"], client.embeddings.create(
        model="embedder", input=rendered, encoding_format="float").data[0].embedding, atol=1e-5)


def decode(binary: bytes, embed_dtype: str, endianness: str) -> np.ndarray:
    """A binary vector as a client reads it: swap to this machine's byte order, then view the dtype."""
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[embed_dtype]
    size = torch.empty((), dtype=dtype).element_size()
    raw = np.frombuffer(binary, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).copy()
    if endianness not in ("native", sys.byteorder):
        raw = raw.byteswap()
    signed = raw.view({1: np.int8, 2: np.int16, 4: np.int32}[size])
    return torch.from_numpy(signed).view(dtype).float().numpy()


def test_vllm_binary_encodings_activation_and_pooling_tasks(server):
    body = {"input": TEXTS[:2]}
    floats = np.array([d["embedding"] for d in post(server, "/v1/embeddings", {**body, "encoding_format": "float"})
                       .json()["data"]])
    tolerance = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2, "fp8_e4m3": 0.07, "fp8_e5m2": 0.13}
    for embed_dtype, atol in tolerance.items():
        for endianness in ("native", "big", "little"):
            extras = {**body, "embed_dtype": embed_dtype, "endianness": endianness}
            b64 = post(server, "/v1/embeddings", {**extras, "encoding_format": "base64"}).json()["data"]
            np.testing.assert_allclose([decode(base64.b64decode(d["embedding"]), embed_dtype, endianness) for d in b64],
                                       floats, atol=atol, rtol=atol)
            raw = post(server, "/v1/embeddings", {**extras, "encoding_format": "bytes"})
            assert raw.headers["content-type"] == "application/octet-stream"
            meta = json.loads(raw.headers["metadata"])
            assert meta["model"] == "embedder" and meta["usage"]["prompt_tokens"] > 0
            assert [(m["index"], m["shape"], m["embed_dtype"]) for m in meta["data"]] == [
                (0, [64], embed_dtype), (1, [64], embed_dtype)]
            np.testing.assert_allclose([decode(raw.content[m["start"]:m["end"]], embed_dtype, endianness)
                                        for m in meta["data"]], floats, atol=atol, rtol=atol)
    only = post(server, "/v1/embeddings", {**body, "encoding_format": "bytes_only"})
    assert "metadata" not in only.headers and len(only.content) == 2 * 64 * 4
    np.testing.assert_allclose(decode(only.content, "float32", "native").reshape(2, 64), floats, atol=1e-6)
    # use_activation (vLLM's name for normalize): off is the pooled hidden state /pooling gives.
    raw_vector = np.array(post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "float",
                                                          "use_activation": False}).json()["data"][0]["embedding"])
    pooled = np.array(post(server, "/pooling", {"input": TEXTS[0]}).json()["data"][0]["data"])
    np.testing.assert_allclose(raw_vector, pooled, atol=1e-5)
    np.testing.assert_allclose(raw_vector / np.linalg.norm(raw_vector), floats[0], atol=1e-5)
    embedded = post(server, "/pooling", {"input": TEXTS[0], "task": "embed"}).json()["data"][0]["data"]
    np.testing.assert_allclose(embedded, floats[0], atol=1e-5)
    # token_embed: a normalised vector per token; the last one is the (LAST-pooled) embedding.
    per_token = np.array(post(server, "/pooling", {"input": TEXTS[0], "task": "token_embed"}).json()["data"][0]["data"])
    assert per_token.shape[1] == 64 and per_token.shape[0] > 1
    np.testing.assert_allclose(np.linalg.norm(per_token, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(per_token[-1], floats[0], atol=1e-5)
    for task in ("classify", "token_classify", "plugin"):
        error = post(server, "/pooling", {"input": "x", "task": task}).json()["error"]
        assert error["type"] == "BadRequestError" and error["message"].startswith(f"Unsupported task: {task!r}")
    for field in ("encoding_format", "embed_dtype", "endianness"):
        response = post(server, "/v1/embeddings", {"input": "x", "encoding_format": "base64", field: f"bad_{field}"})
        assert response.status_code == 400
        assert "literal_error" in response.json()["error"]["message"]
        assert f"bad_{field}" in response.json()["error"]["message"]
    both = post(server, "/v1/embeddings", {"messages": [{"role": "user", "content": "Hi"}],
                                           "continue_final_message": True, "add_generation_prompt": True})
    assert both.status_code == 400
    assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True." in both.json()["error"][
        "message"]


def test_score_and_rerank_follow_the_embeddings(client, server):
    vectors = [np.array(d.embedding) for d in client.embeddings.create(model="embedder", input=TEXTS,
                                                                       encoding_format="float").data]
    expected = [cosine(vectors[0], v) for v in vectors]
    for route in ("/score", "/v1/score"):
        body = post(server, route, {"model": "embedder", "text_1": TEXTS[0], "text_2": TEXTS}).json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    pairwise = post(server, "/score", {"text_1": TEXTS, "text_2": TEXTS[::-1]}).json()
    np.testing.assert_allclose(pairwise["data"][0]["score"], expected[2], atol=1e-5)
    order = sorted(range(3), key=lambda i: -expected[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(server, route, {"query": TEXTS[0], "documents": TEXTS, "top_n": 2}).json()
        assert [r["index"] for r in body["results"]] == order[:2]
        assert body["results"][0]["document"] == {"text": TEXTS[order[0]]}
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                                   [expected[i] for i in order[:2]], atol=1e-5)
        assert body["usage"]["total_tokens"] > 0
    bare = post(server, "/rerank", {"query": TEXTS[0], "documents": [{"text": t} for t in TEXTS],
                                    "return_documents": False}).json()
    assert len(bare["results"]) == 3 and bare["results"][0]["document"] is None


def test_clear_errors(client, server):
    for response in (
        post(server, "/v1/embeddings", {"input": []}),
        post(server, "/v1/embeddings", {"input": [[]]}),
        post(server, "/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "x"}]}),
        post(server, "/v1/embeddings", {"input": [10**7]}),
        post(server, "/v1/embeddings", {"input": "x", "encoding_format": "int8"}),
        post(server, "/v1/embeddings", {"input": " ".join(["word"] * 600)}),
        post(server, "/score", {"text_1": TEXTS[:2], "text_2": TEXTS}),
        post(server, "/rerank", {"query": "x", "documents": []}),
        post(server, "/classify", {"input": "x"}),
    ):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"]
    assert "classification head" in post(server, "/classify", {"input": "x"}).json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.completions.create(model="embedder", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.chat.completions.create(model="embedder", messages=[{"role": "user", "content": "Hi"}])
    invoked = post(server, "/invocations", {"input": TEXTS[0], "encoding_format": "float"}).json()
    np.testing.assert_allclose(invoked["data"][0]["embedding"], client.embeddings.create(
        model="embedder", input=TEXTS[0], encoding_format="float").data[0].embedding, atol=1e-5)
    assert post(server, "/invocations", {"text_1": TEXTS[0], "text_2": TEXTS[1]}).json()["data"][0]["object"] == "score"
    assert "RerankRequest" in post(server, "/invocations", {"prompt": "Hello"}).json()["error"]["message"]
    assert [m.id for m in client.models.list().data] == ["embedder"]
    assert len(client.embeddings.create(model="embedder", input="still serving").data) == 1


def test_pooling_routes_on_a_generating_server(tiny_api_server):
    response = httpx.post(tiny_api_server.url + "/v1/embeddings", json={"input": "Hello"}, timeout=TIMEOUT)
    assert response.status_code == 400
    assert "--runner pooling" in response.json()["error"]["message"]
