"""Server flags vLLM users pass and what they change, against a real server (a tiny random model:
nothing here depends on what the model says): `--chat-template` with the content format it reads."""

from __future__ import annotations

import httpx
import pytest
from remote_server import RemoteServer

openai = pytest.importorskip("openai")

TIMEOUT = 120
# ChatML without SmolLM2's default system prompt, reading content as OpenAI's list of parts
# (`auto` must find that out: a string's characters have no `type`), with Qwen3's switch for thinking.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}[{{ part['type'] }}]{{ part['text'] }}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    server = RemoteServer([
        tiny_llama, "-O0", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
        "--served-model-name", "tiny", "--chat-template", str(template),
    ])
    yield server
    server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def tokenize(server, body: dict) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_template_flag_renders_every_chat(server):
    out = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"return_prompt_text": True})
    expected = "<|im_start|>user\n[text]Hi<|im_end|>\n<|im_start|>assistant\n"
    assert out.model_extra["prompt_text"] == expected
    # /tokenize renders with the same template; the template's kwargs reach it.
    assert tokenize(server, {"messages": MESSAGES}) == tokenize(server, {"prompt": expected,
                                                                          "add_special_tokens": False})
    no_thinking = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1,
        extra_body={"return_prompt_text": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert no_thinking.model_extra["prompt_text"] == expected + "<think>\n\n</think>\n\n"
