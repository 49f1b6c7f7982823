"""LoRA adapters through the server (vLLM's interface): `--lora-modules`, adapters in /v1/models
with their parent, a request selecting one by its `model`, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter behind VLLM_ALLOW_RUNTIME_LORA_UPDATING; each adapter's greedy tokens
those of HF transformers with PEFT's merged adapter, and a bad adapter a 400 that leaves the server
serving."""

from __future__ import annotations

import httpx
import pytest
from remote_server import RemoteServer

from tests.lora.adapters import ALL_TARGETS, make_adapter
from tests.oracle import hf_greedy

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

TIMEOUT = 300
PROMPT_IDS = [[1, 7, 42, 99, 5, 300, 12]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": make_adapter(tiny_llama, root / "all", 8, ALL_TARGETS, seed=1),
        "qv": make_adapter(tiny_llama, root / "qv", 4, ["q_proj", "v_proj"], seed=2),
        "wide": make_adapter(tiny_llama, root / "wide", 16, ["q_proj"], seed=3, merged=False),
    }


@pytest.fixture(scope="module")
def server(tiny_llama, adapters):
    server = RemoteServer([
        tiny_llama, "-O0", "--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20),
        "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"all={adapters['all'][0]}",
    ], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield server
    server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def greedy(server, model: str) -> list[int]:
    reply = client(server).completions.create(model=model, prompt=PROMPT_IDS[0], max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"return_token_ids": True,
                                                                         "ignore_eos": True})
    return reply.choices[0].token_ids


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


def test_adapters_are_listed_and_served_as_hf_merges_them(server, adapters, tiny_llama):
    cards = {m.id: m for m in client(server).models.list().data}
    assert set(cards) == {"tiny", "all"} and cards["all"].model_extra["parent"] == "tiny"
    assert greedy(server, "all") == hf_greedy(adapters["all"][1], PROMPT_IDS, MAX_TOKENS)[0].token_ids
    assert greedy(server, "tiny") == hf_greedy(tiny_llama, PROMPT_IDS, MAX_TOKENS)[0].token_ids
    chat = client(server).chat.completions.create(model="all", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    # The Responses API runs the adapter too: its text is chat's on the same message.
    response = client(server).responses.create(model="all", input="Hi", max_output_tokens=4, temperature=0)
    greedy_chat = client(server).chat.completions.create(model="all", messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=4, temperature=0)
    assert response.output_text == greedy_chat.choices[0].message.content
    assert response.model == greedy_chat.model == "all"  # a response names the adapter it ran with, as vLLM
    base_chat = client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=4, temperature=0)
    assert base_chat.choices[0].message.content != greedy_chat.choices[0].message.content


def test_adapters_load_and_unload_at_run_time(server, adapters):
    """An adapter loaded, served and unloaded while another adapter's stream is open: the stream
    ends with the text the same request gets unstreamed."""
    body = dict(model="all", prompt=PROMPT_IDS[0], max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    expected = client(server).completions.create(**body).choices[0].text
    stream = iter(client(server).completions.create(**body, stream=True))
    streamed = [next(stream).choices[0].text]  # the stream is open from here on
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": adapters["qv"][0]})
    assert r.status_code == 200, r.text
    assert greedy(server, "qv") == hf_greedy(adapters["qv"][1], PROMPT_IDS, MAX_TOKENS)[0].token_ids
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "qv"}).status_code == 200
    assert {m.id for m in client(server).models.list().data} == {"tiny", "all"}
    with pytest.raises(openai.NotFoundError):
        greedy(server, "qv")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "qv"}).status_code == 404
    streamed += [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(streamed) == expected


@pytest.mark.parametrize("body,words", [
    ({"lora_name": "wide", "lora_path": "WIDE"}, "rank"),  # rank 16 above --max-lora-rank 8
    ({"lora_name": "gone", "lora_path": "/nonexistent/adapter"}, "adapter"),
    ({"lora_name": "all", "lora_path": "ALL"}, "taken"),  # the name is in use
])
def test_a_bad_adapter_is_a_400_and_the_server_keeps_serving(server, adapters, body, words):
    body = dict(body, lora_path=body["lora_path"].replace("WIDE", adapters["wide"][0])
                .replace("ALL", adapters["all"][0]))
    r = post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400 and words in r.json()["error"]["message"].lower(), r.text
    assert greedy(server, "all")
