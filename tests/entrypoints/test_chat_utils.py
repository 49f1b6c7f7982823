"""Chat templates the operator gives (a file or inline) and the content format a template reads."""

from __future__ import annotations

import pytest

from compiled_llm.entrypoints.chat_utils import (
    detect_content_format,
    format_content,
    load_chat_template,
    resolve_content_format,
)

STRING_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
PARTS_TEMPLATE = "{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
ASSIGNED_PARTS_TEMPLATE = ("{% for m in messages %}{% set parts = m.content %}{% for p in parts %}{{ p['text'] }}"
                           "{% endfor %}{% endfor %}")


def test_load_from_a_file_or_inline(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(STRING_TEMPLATE)
    assert load_chat_template(str(path)) == STRING_TEMPLATE
    assert load_chat_template(path) == STRING_TEMPLATE
    assert load_chat_template(None) is None
    # Inline, with the escapes a command line carries read as the characters they stand for.
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"
    assert load_chat_template("{{ '→é' }}\\n") == "{{ '→é' }}\n"


def test_a_path_that_cannot_be_read_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_content_format_detection(real_model_path):
    from transformers import AutoTokenizer

    assert detect_content_format(STRING_TEMPLATE) == "string"
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    assert detect_content_format(ASSIGNED_PARTS_TEMPLATE) == "openai"
    assert detect_content_format(AutoTokenizer.from_pretrained(real_model_path).chat_template) == "string"
    assert detect_content_format("{% for") == "string"  # does not parse: rendering will say why
    assert resolve_content_format("auto", PARTS_TEMPLATE) == "openai"
    assert resolve_content_format("string", PARTS_TEMPLATE) == "string"
    with pytest.raises(ValueError, match="one of"):
        resolve_content_format("html", PARTS_TEMPLATE)


def test_format_content():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert format_content(parts, "string") == "a\nb"
    assert format_content("hi", "openai") == [{"type": "text", "text": "hi"}]
    assert format_content(parts, "openai") == parts
    assert format_content(None, "string") == ""
    with pytest.raises(ValueError, match="image_url"):
        format_content([{"type": "image_url", "image_url": {"url": "x"}}], "string")


def test_server_refuses_an_unreadable_template_before_starting(tmp_path):
    from compiled_llm.entrypoints.openai.server_args import ServerArgs

    with pytest.raises(ValueError, match="looks like a file path"):
        ServerArgs(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="content-format"):
        ServerArgs(chat_template_content_format="html")


def test_offline_chat_uses_the_given_template(tiny_llama):
    from compiled_llm import LLM, SamplingParams

    llm = LLM(tiny_llama, chat_template=PARTS_TEMPLATE, optimization_level=0, max_model_len=256,
              kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(max_tokens=1)
    conversation = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [{"type": "text", "text": "!"}]}]
    assert llm.chat(conversation, params, use_tqdm=False)[0].prompt == "Hi!"  # LLM's template, content as parts
    assert llm.chat(conversation, params, use_tqdm=False, chat_template=STRING_TEMPLATE)[0].prompt == \
        "user: Hi\nassistant: !\n"  # the call's own, content as a string
    assert llm.chat(conversation, params, use_tqdm=False, chat_template="{{ messages | length }}{{ x }}",
                    chat_template_kwargs={"x": "!"})[0].prompt == "2!"


def test_named_templates_of_a_tokenizer_resolve(tmp_path):
    """A tokenizer_config.json listing named templates gives transformers a dict `chat_template`
    (it picks "default" or "tool_use" per call): auto must read them, not fail on every chat request."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    saved = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, "<unk>")))
    saved.chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": "T{{ messages[0]['content'] }}"}
    saved.save_pretrained(tmp_path)
    template = AutoTokenizer.from_pretrained(tmp_path).chat_template
    assert isinstance(template, dict)
    assert resolve_content_format("auto", template) == "string"
    looping = {**template, "tool_use": "{% for p in messages[0]['content'] %}{{ p['text'] }}{% endfor %}"}
    assert resolve_content_format("auto", looping) == "openai"
    assert resolve_content_format("string", looping) == "string"
