"""The transformers-free tokenizer (issue 25: a warm start without importing transformers): it must
answer exactly as transformers' tokenizer on the same files, and be used only where it was found to.

Oracle: transformers' own tokenizer and chat template rendering, on the bundled model's tokenizer
and on templates that use what Hub templates use (namespaces, loop controls, tojson with options,
tools, reasoning fields, the generation block, raise_exception)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_llm.engine.chat_template_render import render_chat_template
from compiled_llm.engine.fast_tokenizer import META_FILE, FastTokenizer
from compiled_llm.engine.tokenizer import get_tokenizer
from compiled_llm.engine.tokenizer_snapshot import first_difference, load_snapshot, snapshot_folder, write_snapshot


@pytest.fixture(scope="module")
def hf_tokenizer(real_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_path)


@pytest.fixture(scope="module")
def fast(real_model_path, hf_tokenizer) -> FastTokenizer:
    write_snapshot(real_model_path, hf_tokenizer)
    snapshot = load_snapshot(real_model_path)
    assert snapshot is not None, json.loads((snapshot_folder(real_model_path) / META_FILE).read_text())["difference"]
    return snapshot


def test_the_bundled_tokenizer_is_served_from_its_snapshot(real_model_path, fast, hf_tokenizer):
    assert isinstance(get_tokenizer(real_model_path), FastTokenizer)
    assert first_difference(hf_tokenizer, fast) is None
    assert fast.eos_token == "<|im_end|>" and fast.eos_token_id == hf_tokenizer.eos_token_id
    assert fast.all_special_ids == hf_tokenizer.all_special_ids
    assert len(fast) == len(hf_tokenizer) and fast.vocab_size == hf_tokenizer.vocab_size
    assert fast.added_tokens_encoder == hf_tokenizer.added_tokens_encoder


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT, special=st.sampled_from(["", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
       add=st.booleans(), skip=st.booleans())
def test_encode_and_decode_equal_transformers(fast, hf_tokenizer, text, special, add, skip):
    text = special.join([text, text[::-1]])
    ids = fast(text, add_special_tokens=add)["input_ids"]
    assert ids == hf_tokenizer(text, add_special_tokens=add)["input_ids"]
    assert fast.encode(text, add_special_tokens=add) == hf_tokenizer.encode(text, add_special_tokens=add)
    assert fast.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert fast.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), max_size=30), skip=st.booleans())
def test_any_ids_decode_as_transformers_decodes_them(fast, hf_tokenizer, ids, skip):
    assert fast.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)
    tokens = hf_tokenizer.convert_ids_to_tokens(ids)
    assert fast.convert_tokens_to_ids(tokens) == hf_tokenizer.convert_tokens_to_ids(tokens)


# Templates that use what the Hub's do; each renders through both implementations.
TEMPLATES = {
    "chatml_tools": (
        "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
        "<|im_end|>\n{%- endif %}"
        "{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls is defined %}"
        "<|im_start|>assistant\n{%- if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n"
        "</think>\n{%- endif %}{%- for call in message.tool_calls %}<tool_call>\n"
        "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson(indent=2) }}\n"
        "</tool_call>{%- endfor %}<|im_end|>\n"
        "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined and not "
        "enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"),
    "namespace_and_loops": (
        "{{ bos_token }}{%- set ns = namespace(n=0, last='') %}{%- for m in messages %}"
        "{%- if m.role == 'system' %}{% continue %}{% endif %}{%- set ns.n = ns.n + 1 %}"
        "[{{ ns.n }}:{{ m.role | upper }}] {{ m.content | trim }}{%- if loop.last %}{% break %}{% endif %}\n"
        "{%- set ns.last = m.role %}{%- endfor %}"
        "{%- if add_generation_prompt %}\n[{{ ns.n + 1 }}:ASSISTANT]{% endif %}{{ eos_token if not "
        "add_generation_prompt else '' }}"),
    "strict_roles": (
        "{%- for m in messages %}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif %}{% generation %}{{ m.role }}: {{ m.content }}{% endgeneration %}\n{%- endfor %}"
        "{{ dict(a=1, b=messages | length) | tojson(sort_keys=True, separators=[',', ':']) }}"),
    "content_parts": (
        "{%- for m in messages %}{{ m.role }}:{%- if m.content is string %}{{ m.content }}{%- else %}"
        "{%- for p in m.content %}[{{ p.type }}]{{ p.text }}{%- endfor %}{%- endif %}|{%- endfor %}"),
}

_ROLES = st.sampled_from(["system", "user", "assistant", "tool"])
_MESSAGE = st.fixed_dictionaries(
    {"role": _ROLES, "content": st.one_of(st.none(), _TEXT, st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": _TEXT}), max_size=2))},
    optional={"reasoning_content": st.one_of(st.none(), _TEXT), "name": _TEXT})


def _both(hf_tokenizer, fast, messages, **options):
    outcomes = []
    for render in (lambda: hf_tokenizer.apply_chat_template(messages, tokenize=False, **options),
                   lambda: fast.apply_chat_template(messages, tokenize=False, **options)):
        try:
            outcomes.append(("ok", render()))
        except Exception as e:  # noqa: BLE001 - both must fail alike
            outcomes.append(("error", type(e).__name__))
    return outcomes


@pytest.mark.parametrize("name", sorted(TEMPLATES) + ["model's own"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(_MESSAGE, min_size=1, max_size=4), generation=st.booleans(), cont=st.booleans())
def test_chat_templates_render_as_transformers_renders_them(fast, hf_tokenizer, name, messages, generation, cont):
    options = {"chat_template": TEMPLATES.get(name), "add_generation_prompt": generation and not cont,
               "continue_final_message": cont}
    ours, theirs = _both(hf_tokenizer, fast, messages, **options)
    assert ours == theirs


def test_tools_reasoning_and_template_variables_render_alike(fast, hf_tokenizer):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "é 東京"}}}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning": "Use the tool.",
                 "tool_calls": [{"id": "1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "18 C", "tool_call_id": "1"}]
    for enable_thinking in (True, False):
        ours, theirs = _both(hf_tokenizer, fast, messages, chat_template=TEMPLATES["chatml_tools"], tools=[tool],
                             add_generation_prompt=True, enable_thinking=enable_thinking)
        assert ours == theirs and ours[0] == "ok"
        assert "<think>\nUse the tool.\n</think>" in ours[1]
    ours, theirs = _both(hf_tokenizer, fast, [{"role": "assistant", "content": "x"}],
                         chat_template=TEMPLATES["strict_roles"])
    assert ours == theirs == ("error", "TemplateError")
    sneaky = "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}"
    assert _both(hf_tokenizer, fast, [{"role": "user", "content": "x"}], chat_template=sneaky)[0][0] == "error"
    ids = fast.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids["input_ids"] == hf_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                add_generation_prompt=True)["input_ids"]


def test_render_refuses_what_transformers_refuses():
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat_template("{{ messages }}", [])
    with pytest.raises(ValueError, match="not compatible"):
        render_chat_template("{{ messages }}", [{"role": "user", "content": "x"}], add_generation_prompt=True,
                             continue_final_message=True)
    with pytest.raises(TypeError, match="should be dicts"):
        render_chat_template("{{ messages }}", ["hello"])


def test_a_snapshot_that_differs_or_is_damaged_is_not_used(real_model_path, fast, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILED_LLM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(real_model_path) / name).exists():
            shutil.copy(Path(real_model_path) / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["model_max_length"] = 4096  # other files, another snapshot
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    first = get_tokenizer(str(folder))
    assert not isinstance(first, FastTokenizer)  # the first load is transformers', and writes the snapshot
    snapshot = snapshot_folder(folder)
    assert isinstance(get_tokenizer(str(folder)), FastTokenizer)
    meta = json.loads((snapshot / META_FILE).read_text())
    assert meta["model_max_length"] == 4096 and meta["equal"] is True
    # A snapshot whose special tokens were wrong would be caught by the comparison...
    wrong = FastTokenizer(fast._tokenizer, {**meta, "special_tokens_map": {**meta["special_tokens_map"],
                                                                        "eos_token": "<|endoftext|>"}})
    assert first_difference(first, wrong) == "special tokens"
    # ... and one found unequal, or damaged, is passed over for transformers.
    (snapshot / META_FILE).write_text(json.dumps({**meta, "equal": False, "difference": "decodings"}))
    assert not isinstance(get_tokenizer(str(folder)), FastTokenizer)
    (snapshot / META_FILE).write_text("{not json")
    assert not isinstance(get_tokenizer(str(folder)), FastTokenizer)  # ... which writes it again
    assert isinstance(get_tokenizer(str(folder)), FastTokenizer)
    # An edit to a tokenizer file is a new key.
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert snapshot_folder(folder) != snapshot


def test_template_workers_import_neither_torch_nor_transformers(real_model_path, fast):
    """What a chat template worker imports, in a fresh interpreter: the start-up path (issue 25)."""
    code = (
        "import sys\n"
        "from compiled_llm.engine.chat_templates import _worker_main\n"
        "from compiled_llm.engine.tokenizer_snapshot import load_chat_templates\n"
        f"text = load_chat_templates({real_model_path!r}).render([{{'role': 'user', 'content': 'hi'}}])\n"
        "from compiled_llm.engine.tokenizer import get_tokenizer\n"
        f"t = get_tokenizer({real_model_path!r})\n"
        "assert text == t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
        "print(type(t).__name__, 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["FastTokenizer", "False", "False"]
