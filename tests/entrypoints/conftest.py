"""One server for the API feature tests (structured outputs, tools, scoring, the remaining
fields, lm-eval): the bundled model, compiled from the warm compile cache, with auto tool choice
parsed in the Hermes format. Started once per session and shared, to keep the suite short.

And one on a tiny random model, uncompiled, for what does not depend on the model's words (the
output is forced, or only its shape matters), with the optional server flags switched on: its own
chat template, the tokenizer info and load routes, auto tool choice (Hermes), reasoning (qwen3: an
output that does not open a <think> block is all content), the Responses API's store."""

from __future__ import annotations

import pytest
from remote_server import RemoteServer

API_SERVER_FLAGS = [
    "-O1", "--require-cache-hit", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20),
    "--max-num-seqs", "32", "--served-model-name", "smol", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--enable-prompt-tokens-details",
]


@pytest.fixture(scope="session")
def api_server(real_model_path, warm_compile_cache):
    pytest.importorskip("openai")  # absent on the GPU image, where only cuda tests run
    server = RemoteServer([real_model_path, *API_SERVER_FLAGS])
    yield server
    server.stop()


# ChatML without SmolLM2's default system prompt, reading content as OpenAI's list of parts
# (`auto` must find that out: a string's characters have no `type`), with Qwen3's switch for thinking.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}[{{ part['type'] }}]{{ part['text'] }}{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_api_server(tiny_llama, tmp_path_factory):
    pytest.importorskip("openai")
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TINY_CHAT_TEMPLATE)
    server = RemoteServer([
        tiny_llama, "-O0", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
        "--served-model-name", "tiny", "--chat-template", str(template), "--enable-tokenizer-info-endpoint",
        "--enable-server-load-tracking", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3",
    ], env={"COMPILED_LLM_ENABLE_RESPONSES_API_STORE": "1"})
    yield server
    server.stop()
