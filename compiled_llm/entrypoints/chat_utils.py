"""Chat templates given by the operator (`--chat-template`, `LLM(chat_template=...)`) and the shape
message content takes when it reaches a template (`--chat-template-content-format`), as vLLM.

A model may ship no chat template, or a wrong one: the operator gives one, as a file or inline.
Templates read message content in one of two ways: as a string (`message['content']`, most
templates) or as OpenAI's list of parts (`{% for part in message['content'] %}`, templates of
multimodal models). `auto` finds out which by reading the template's syntax tree.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # imported where a template is parsed: the server's settings are read before the
    import jinja2.nodes  # engine forks, and jinja2's import (0.08 s) need not delay it

ChatTemplateContentFormatOption = Literal["auto", "string", "openai"]
ChatTemplateContentFormat = Literal["string", "openai"]
CONTENT_FORMATS: tuple[str, ...] = ("auto", "string", "openai")
# Characters a path never holds but a template nearly always does (vLLM's rule for "inline").
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(chat_template: str | Path | None) -> str | None:
    """The template itself: the file's text if `chat_template` names a readable file, else the
    string (with its backslash escapes read, so that `\\n` given on a command line is a newline).
    A string that looks like a path but cannot be read is an error rather than a one-line template."""
    if chat_template is None:
        return None
    try:
        return Path(chat_template).read_text()
    except (OSError, ValueError) as e:
        if isinstance(chat_template, Path) or not any(c in chat_template for c in _TEMPLATE_CHARS):
            raise ValueError(f"The chat template {str(chat_template)!r} looks like a file path, but it could not be "
                             f"read ({e}); give a readable file or the template itself.") from e
    # Characters beyond Latin-1 pass through as their own escapes, which the decoding reads back.
    return chat_template.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _is_content_access(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """`node` reads a message's content: `x['content']` or `x.content` (x any expression), or a
    name assigned from one of those."""
    import jinja2.nodes

    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Name):
        return node.name in names
    if isinstance(node, jinja2.nodes.Filter):  # `message['content'] | selectattr(...)` still loops over parts
        return node.node is not None and _is_content_access(node.node, names)
    return False


@functools.lru_cache(maxsize=32)
def detect_content_format(chat_template: str | None) -> ChatTemplateContentFormat:
    """`openai` if the template loops over a message's content (it expects a list of parts), else
    `string`. A template that does not parse is `string`: rendering it will say what is wrong."""
    if not chat_template:
        return "string"
    import jinja2
    import jinja2.nodes

    try:
        tree = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateError:
        return "string"
    content_names: set[str] = set()
    for assign in tree.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and _is_content_access(assign.node, content_names):
            content_names.add(assign.target.name)
    for loop in tree.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter, content_names):
            return "openai"
    return "string"


def resolve_content_format(option: str, chat_template: str | dict[str, str] | None) -> ChatTemplateContentFormat:
    """The format for `option` with this template (`auto`: as the template reads content). A
    tokenizer whose tokenizer_config.json lists named templates ("default", "tool_use") has a dict
    for its `chat_template`, and transformers picks one per call: `openai` if any of them loops over
    content."""
    if option not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got {option!r}.")
    if option != "auto":
        return option  # type: ignore[return-value]
    if isinstance(chat_template, dict):
        formats = {detect_content_format(t) for t in chat_template.values() if isinstance(t, str)}
        return "openai" if "openai" in formats else "string"
    return detect_content_format(chat_template)


def text_parts(content: Any) -> list[str]:
    """The texts of a message's content (a string, None, or a list of parts); any part that is not
    text is a ValueError (this server serves text models)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"Only text content parts are supported, got type {kind!r}.")
        texts.append(part["text"])
    return texts


def format_content(content: Any, content_format: ChatTemplateContentFormat) -> str | list[dict[str, str]]:
    """A message's content as the template reads it: one string (parts joined by newlines), or
    OpenAI's list of text parts (a string becomes one part)."""
    texts = text_parts(content)
    if content_format == "openai":
        return [{"type": "text", "text": text} for text in texts]
    return "\n".join(texts)
