"""Chat templates rendered as transformers renders them, with jinja2 alone.

A server renders every chat request, and its template workers are fresh processes: importing
transformers for this (0.5-0.8 s on a 2-core machine, before any render) would sit on the start-up
path. So the rules transformers applies are kept here, and checked against transformers itself
when a tokenizer snapshot is written (`tokenizer_snapshot.py`) and in tests:

- the Jinja environment: sandboxed and immutable, `trim_blocks` and `lstrip_blocks`, loop controls,
  a `{% generation %}` block that renders its body, `tojson` without HTML escaping (and with
  `indent`, `separators`, `sort_keys`), `raise_exception`, `strftime_now`, and `dict` and `namespace`
  that refuse underscore names;
- what the template sees: plain JSON data only (anything else becomes "<TypeName>"), messages
  without their None-valued keys, a message's reasoning under `reasoning_content` and `thinking`
  whichever name it came in, the special tokens (`bos_token`...) under the caller's variables;
- `continue_final_message`: the text ends where the final message's content ends.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training masks;
    rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without the type's other attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so no template reaches Python's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature, so `namespace(self=...)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env.from_string(template)


def _objects_to_dicts(value: Any) -> Any:
    """Message objects (pydantic models, as the openai client returns them) as dicts, nested too."""
    if isinstance(value, Mapping):
        return {key: _objects_to_dicts(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_objects_to_dicts(item) for item in value)
    if callable(getattr(value, "model_dump", None)):
        return _objects_to_dicts(value.model_dump())
    return value


def plain_data(value: Any) -> Any:
    """What a template may see: JSON's types (subclasses cut back to them); anything else is a
    placeholder naming its type, so no object's methods reach the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    if callable(getattr(value, "item", None)) and type(value).__module__ == "numpy":  # a numpy scalar
        return plain_data(value.item())
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def select_template(chat_template: str | dict[str, str] | None, name: str | None = None,
                    tools: Any = None) -> str:
    """The template to render: `name` is a template's text, or the name of one of the model's
    several (`default`, `tool_use` when tools are given)."""
    if isinstance(chat_template, dict):
        if name is not None and name in chat_template:
            return chat_template[name]
        if name is None:
            if tools is not None and "tool_use" in chat_template:
                return chat_template["tool_use"]
            if "default" in chat_template:
                return chat_template["default"]
            raise ValueError("This model has multiple chat templates with no default specified! Available "
                             f"template names are {sorted(chat_template)}.")
        return name
    if name is not None:
        return name
    if chat_template is None:
        raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                         "template argument was passed!")
    return chat_template


def render_chat_template(
    template: str,
    messages: Any,
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    special_tokens: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> str:
    """`messages` (one conversation) rendered by `template` as transformers' `apply_chat_template(...,
    tokenize=False)` would render it; `special_tokens`: the tokenizer's (`bos_token`...), which the
    caller's `kwargs` override."""
    if isinstance(messages, (list, tuple)) and not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    chat = []
    for message in _objects_to_dicts(getattr(messages, "messages", messages)):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        chat.append({key: value for key, value in message.items() if value is not None})
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible. Use "
                         "continue_final_message when you want the model to continue the final message, and "
                         "add_generation_prompt when you want to add a header that will prompt it to start a new "
                         "assistant message instead.")
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise ValueError("Tools should either be a JSON schema, or a callable function with type hints and a "
                             "docstring suitable for auto-conversion to a schema.")
    for document in documents or ():
        if not isinstance(document, dict):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    variables = plain_data({**(special_tokens or {}), **kwargs})
    chat = [_with_reasoning_aliases(m) for m in plain_data(chat)]
    final_message = None
    if continue_final_message:
        final_message = _tag_final_message(template, chat, continue_final_message)
    text = compile_template(template).render(messages=chat, tools=plain_data(tools), documents=plain_data(documents),
                                             add_generation_prompt=add_generation_prompt, **variables)
    if final_message is None:
        return text
    if final_message.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template! This can happen if the chat template deletes portions of the "
                         f"final message. Final message to continue: {final_message.strip()}")
    at = text.rindex(_CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _tag_final_message(template: str, chat: list[dict[str, Any]], field: bool | str) -> str:
    """Mark where the final message's text ends (it is cut there after rendering); its text."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field] if field not in REASONING_FIELDS else [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         "chat_template")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final "
                         "message!")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


class ChatTemplates:
    """A model's chat template (or its named templates) and special tokens: what rendering needs of
    a tokenizer (a chat template worker holds only this, where the tokenizer has a snapshot)."""

    def __init__(self, chat_template: str | dict[str, str] | None, special_tokens: Mapping[str, Any]) -> None:
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)

    def render(self, conversation: Any, chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False,
               continue_final_message: bool | str = False, **kwargs: Any) -> str:
        """transformers' `apply_chat_template(conversation, tokenize=False, ...)` for one conversation."""
        for option in ("tokenizer_kwargs", "return_assistant_tokens_mask", "sanitize_control_tokens", "return_tensors"):
            if kwargs.pop(option, None):
                raise NotImplementedError(f"{option} is not served here: load the tokenizer with transformers.")
        if isinstance(conversation, (list, tuple)) and conversation and (
                isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")):
            raise NotImplementedError("One conversation at a time: a batch is not served here.")
        template = select_template(self.chat_template, chat_template, tools)
        return render_chat_template(template, conversation, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, special_tokens=self.special_tokens,
                                    **kwargs)
