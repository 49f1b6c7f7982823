"""A request's constraint in one canonical, hashable form, and its validation.

`GrammarSpec` is what the grammar cache is keyed by: the same schema given as a dict or as JSON
text with other spacing is one spec (key order is kept: it is the order of the output's
properties), and a choice list is an EBNF grammar of its literals. Validation parses the
constraint with xgrammar (no tokenizer, no compilation: cheap), so that a bad schema, regex or
grammar is refused with xgrammar's reason before the request reaches the engine.

It sits beside `sampling_params` rather than in `core/structured_outputs/`: the frontend validates
with it and the engine core keys its grammars by it, so both import it and neither reaches into
the other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from compiled_llm.sampling_params import SamplingParams, StructuredOutputsParams

# What xgrammar compiles: a JSON schema, a JSON object, a regex, or an EBNF grammar.
KINDS = ("json", "json_object", "regex", "grammar")

# xgrammar parses these JSON-schema keywords but does not enforce them: an output could break them.
_UNENFORCED_ARRAY_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains")

# The deepest nesting of subschemas a JSON schema may have. xgrammar's time to parse and compile a
# schema grows with about the fourth power of its depth (a chain of 64 nested objects parses in
# 0.03 s, of 150 in 0.4 s, of 400 in 12 s, and compiling costs as much again), so a deeper one is
# refused before xgrammar sees it. OpenAI's own structured outputs allow 10 levels.
MAX_JSON_SCHEMA_DEPTH = 32

# The time a constraint may take to parse (in the frontend) and again to compile (in the engine),
# past which its request is refused: the bound for what the depth limit does not catch (a huge
# grammar or regex). Neither runs on a thread that other requests wait for.
GRAMMAR_TIME_LIMIT_S = 10.0

# xgrammar's messages start with a timestamp and its C++ source position: noise to a user.
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    text: str  # the schema (canonical JSON), the regex or the EBNF grammar; "" for json_object
    any_whitespace: bool = True  # JSON: free whitespace between tokens


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The canonical spec of `params` (ValueError for a schema that is not JSON)."""
    any_whitespace = not params.disable_any_whitespace
    if params.json is not None:
        schema: Any = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"The structured outputs JSON schema is not valid JSON: {e}.") from None
        # Key order stays: the grammar emits properties in the schema's order.
        return GrammarSpec("json", json.dumps(schema, separators=(",", ":")), any_whitespace)
    if params.json_object:
        return GrammarSpec("json_object", "", any_whitespace)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice is not None:
        return GrammarSpec("grammar", choice_grammar(params.choice))
    assert params.grammar is not None  # StructuredOutputsParams holds exactly one constraint
    return GrammarSpec("grammar", params.grammar)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def validate_structured_outputs(params: SamplingParams | StructuredOutputsParams | None) -> GrammarSpec | None:
    """Refuse (ValueError naming the problem) a constraint xgrammar cannot parse or enforce;
    returns its spec (None without a constraint)."""
    if isinstance(params, SamplingParams):
        params = params.structured_outputs
    if params is None:
        return None
    spec = grammar_spec(params)
    check_spec(spec)
    return spec


@lru_cache(maxsize=1024)
def check_spec(spec: GrammarSpec) -> None:
    """Parse `spec` with xgrammar (cached: a repeated spec is checked once)."""
    what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar"}[spec.kind]
    if spec.kind == "json":
        _check_enforceable(json.loads(spec.text), "#", 0)  # before xgrammar is even loaded
    import xgrammar as xgr

    if "\x00" in spec.text:
        raise ValueError(f"The structured outputs {what} must not contain a NUL character.")
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.text)
    except Exception as e:  # xgrammar raises RuntimeError (and others) for what it cannot parse
        raise ValueError(f"Invalid structured outputs {what}: {xgrammar_message(e)}") from None


def xgrammar_message(error: BaseException) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(error)).strip()


def _check_enforceable(schema: Any, path: str, depth: int) -> None:
    """Refuse schema keywords that xgrammar would silently drop (the output could break them), and
    subschemas nested deeper than `MAX_JSON_SCHEMA_DEPTH`. Only subschemas are walked: property
    names, `enum` and `default` values are data."""
    if not isinstance(schema, dict):
        return
    if depth > MAX_JSON_SCHEMA_DEPTH:
        raise ValueError(
            f"The JSON schema nests subschemas more than {MAX_JSON_SCHEMA_DEPTH} levels deep (at {path}): "
            f"at most {MAX_JSON_SCHEMA_DEPTH} are allowed, as deeper ones take seconds to minutes to compile."
        )
    for keyword in _UNENFORCED_ARRAY_KEYWORDS:
        if keyword in schema:
            raise ValueError(f"The JSON schema's {keyword!r} at {path} cannot be enforced (xgrammar ignores it).")
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        raise ValueError(
            f"The JSON schema at {path} combines a pattern or format with minLength/maxLength, which xgrammar "
            "cannot enforce together."
        )
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _check_enforceable(sub, f"{path}/{key}/{name}", depth + 1)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _check_enforceable(sub, f"{path}/{key}/{i}", depth + 1)
        elif key in _SUBSCHEMAS:
            _check_enforceable(value, f"{path}/{key}", depth + 1)


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "propertyNames",
               "unevaluatedProperties", "additionalItems", "unevaluatedItems")
