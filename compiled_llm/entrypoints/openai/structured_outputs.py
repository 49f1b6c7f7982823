"""The one output constraint a request asks for, whichever way it spells it: OpenAI's
`response_format`, vLLM's `structured_outputs` object, or vLLM's older `guided_*` fields.

Two constraints at once, or an option this server does not implement, is a 400 that names it.
Whether a schema, regex or grammar is itself valid is the engine frontend's to judge (its
ValueError is a 400 too).
"""

from __future__ import annotations

from typing import Any

from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.protocol import SamplingRequest
from compiled_llm.logger import init_logger
from compiled_llm.sampling_params import StructuredOutputsParams

logger = init_logger(__name__)

# What runs whatever a request names (vLLM's "auto" picks among backends; here there is one).
GRAMMAR_BACKENDS = ("xgrammar", "auto")


def _from_response_format(request: SamplingRequest) -> dict[str, Any] | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise OpenAIError("response_format of type json_schema needs its `json_schema` object.",
                              param="response_format")
        schema = fmt.json_schema.json_schema
        return {"json": schema} if schema is not None else {"json_object": True}
    raise OpenAIError(f"response_format of type {fmt.type} is not supported by this server.", param="response_format")


def _from_structured_outputs(request: SamplingRequest) -> dict[str, Any] | None:
    so = request.structured_outputs
    if so is None:
        return None
    for option in ("disable_additional_properties", "whitespace_pattern", "structural_tag"):
        if getattr(so, option):
            raise OpenAIError(f"structured_outputs.{option} is not supported by this server.",
                              param=f"structured_outputs.{option}")
    kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
    found = {k: v for k, v in kinds.items() if v is not None}
    if so.json_object:
        found["json_object"] = True
    return found


def _from_guided_fields(request: SamplingRequest) -> dict[str, Any] | None:
    if request.guided_whitespace_pattern:
        raise OpenAIError("guided_whitespace_pattern is not supported by this server.",
                          param="guided_whitespace_pattern")
    backend = request.guided_decoding_backend
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise OpenAIError(f"guided_decoding_backend {backend!r} is not available: this server constrains outputs "
                          "with xgrammar.", param="guided_decoding_backend")
    kinds = {"json": request.guided_json, "regex": request.guided_regex, "choice": request.guided_choice,
             "grammar": request.guided_grammar}
    found = {k: v for k, v in kinds.items() if v is not None}
    return found or None


def requested_structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's constraint for the engine, or None for free text."""
    sources = {
        "response_format": _from_response_format(request),
        "structured_outputs": _from_structured_outputs(request),
        "guided_json/guided_regex/guided_choice/guided_grammar": _from_guided_fields(request),
    }
    given = {name: kinds for name, kinds in sources.items() if kinds}
    if not given:
        if request.structured_outputs is not None:
            raise OpenAIError("structured_outputs needs one of json, json_object, regex, choice or grammar.",
                              param="structured_outputs")
        return None
    if len(given) > 1:
        raise OpenAIError(f"Give one output constraint, not several: got {' and '.join(given)}.",
                          param=next(iter(given)))
    (source, kinds), = given.items()
    if len(kinds) > 1:
        raise OpenAIError(f"{source} takes exactly one of json, json_object, regex, choice or grammar, "
                          f"got {', '.join(kinds)}.", param=source.split("/")[0])
    compact = bool(request.structured_outputs and request.structured_outputs.disable_any_whitespace)
    try:
        return StructuredOutputsParams(**kinds, disable_any_whitespace=compact)
    except ValueError as e:
        raise OpenAIError(str(e), param=source.split("/")[0]) from e
