"""Reading JSON that a model is still writing: where a value ends, if it has ended yet, and the
fields of a tool-call object `{"name": ..., "arguments": ...}` read so far.

Tool-call parsers run on every streamed delta over the text so far; they need to know what of a
call is final (its name once the string closes, its arguments as far as they go) without a full
JSON parser that fails on an unfinished text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = " \t\r\n"
_SCALAR = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
# Keys models use for a call's arguments (Hermes and xLAM say "arguments"; Llama-style "parameters").
ARGUMENT_KEYS = ("arguments", "parameters")


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def string_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON string opening at `text[start]`, or None if it is still open."""
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON value starting at `text[start]`, or None if the text stops
    before it does. Brackets and strings are tracked, not validated: `json.loads` judges the
    finished value."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return string_end(text, start)
    if first in "{[":
        depth = 0
        i = start
        while i < len(text):
            c = text[i]
            if c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    match = _SCALAR.match(text, start)
    if match is None or match.end() == start:
        return start + 1  # not JSON: a one-character "value" that json.loads will refuse
    # A number may go on ("12" of "123"): it has ended only once something follows it.
    return match.end() if match.end() < len(text) else None


@dataclass
class ScannedCall:
    """A `{"name": ..., "arguments": ...}` object as far as it is written."""

    name: str | None = None
    arguments: str = ""  # the arguments' JSON text so far (a string's value once it has closed)
    arguments_done: bool = False
    end: int | None = None  # after its closing brace, once closed
    broken: bool = False  # not a call object (or not JSON): no later text can make it one


def scan_call(text: str, start: int) -> ScannedCall:
    """Read the call object opening at `text[start]` (which must be `{`)."""
    call = ScannedCall()
    if start >= len(text) or text[start] != "{":
        call.broken = start < len(text)
        return call
    pos = start + 1
    while True:
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            return call
        c = text[pos]
        if c == "}":
            call.end = pos + 1
            if not call.arguments:
                call.arguments, call.arguments_done = "{}", True  # a call that takes no arguments
            return call
        if c == ",":
            pos += 1
            continue
        if c != '"':
            call.broken = True
            return call
        key_end = string_end(text, pos)
        if key_end is None:
            return call
        key = json.loads(text[pos:key_end])
        pos = skip_whitespace(text, key_end)
        if pos >= len(text):
            return call
        if text[pos] != ":":
            call.broken = True
            return call
        pos = skip_whitespace(text, pos + 1)
        if pos >= len(text):
            return call
        end = value_end(text, pos)
        if key == "name":
            if end is not None:
                try:
                    name = json.loads(text[pos:end])
                except ValueError:
                    name = None
                if not isinstance(name, str):
                    call.broken = True
                    return call
                call.name = name
        elif key in ARGUMENT_KEYS:
            if text[pos] in "{[":  # an object's text streams as it comes: every character is its own
                call.arguments = text[pos : end if end is not None else len(text)]
            elif end is not None:  # a string (JSON inside JSON) or a scalar: only once whole
                try:
                    value = json.loads(text[pos:end])
                except ValueError:
                    call.broken = True
                    return call
                call.arguments = value if isinstance(value, str) else text[pos:end]
            call.arguments_done = end is not None
        if end is None:
            return call
        pos = end
