"""How a chat request uses its tools: which `tool_choice` applies, what constrains the output,
and how the finished or streamed text becomes `tool_calls`.

- `none`: the model answers in text (the tools still reach the chat template, as in vLLM).
- `auto`: the model decides; its text is parsed with the server's `--tool-call-parser`.
- `required`: the output is constrained (structured outputs) to a JSON array of one or more
  `{"name", "arguments"}` calls, each `arguments` matching its function's parameter schema.
- a named function: the output is constrained to that function's arguments.

The older `functions` / `function_call` fields are the same with one call, answered in the older
`message.function_call` shape.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.protocol import ChatCompletionRequest, FunctionDefinition
from compiled_llm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    FunctionCallText,
    ToolCallStreamer,
    ToolParser,
)
from compiled_llm.entrypoints.openai.tool_parsers.base import ParsedText
from compiled_llm.entrypoints.openai.tool_parsers.partial_json import ScannedCall, skip_whitespace
from compiled_llm.entrypoints.openai.tool_parsers.xlam import scan_calls
from compiled_llm.sampling_params import StructuredOutputsParams

ToolMode = Literal["none", "auto", "required", "named"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class RequiredCallsParser(ToolParser):
    """The output of `tool_choice: required`: a bare JSON array of calls (the grammar's shape).
    Its text is never content: cut short (max_tokens), it is no call and no content, as vLLM and
    OpenAI answer."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedText:
        return ParsedText("", scan_calls(text, 0))

    def extract(self, text: str) -> ExtractedToolCalls:
        extracted = super().extract(text)
        return ExtractedToolCalls("", extracted.calls)


class NamedCallParser(ToolParser):
    """The output of a named `tool_choice`: the function's arguments, nothing else."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedText:
        arguments = text[skip_whitespace(text, 0):]
        if final:
            arguments = arguments.rstrip()
        call = ScannedCall(self.function_name, arguments, arguments_done=final, end=len(text) if final else None)
        return ParsedText("", [call])

    def extract(self, text: str) -> ExtractedToolCalls:
        """The grammar made the text the call's arguments; arguments cut short (max_tokens) are no
        call (and, as for `required`, no content)."""
        arguments = text.strip()
        try:
            json.loads(arguments)
        except ValueError:
            return ExtractedToolCalls("", [])
        return ExtractedToolCalls("", [FunctionCallText(self.function_name, arguments)])


def _hoisted_definitions(parameters: dict[str, Any], into: dict[str, Any]) -> dict[str, Any]:
    """`parameters` without its `$defs`, which go to the top of the combined schema (a `$ref` to
    `#/$defs/X` must still resolve there)."""
    parameters = copy.deepcopy(parameters)
    for key in ("$defs", "definitions"):
        for name, definition in (parameters.pop(key, None) or {}).items():
            if into.get(name, definition) != definition:
                raise OpenAIError(f"Two tools define `{name}` differently in their $defs; tool_choice required "
                                  "needs one definition per name.", param="tools")
            into[name] = definition
    return parameters


def required_calls_schema(functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls (one if not `parallel`), each the name of a function and
    arguments matching that function's parameters."""
    definitions: dict[str, Any] = {}
    variants = []
    for function in functions:
        parameters = _hoisted_definitions(function.parameters or EMPTY_PARAMETERS, definitions)
        variants.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [function.name]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {
        "type": "array", "minItems": 1, "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
    }
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


@dataclass
class ToolPlan:
    mode: ToolMode = "none"
    functions: list[FunctionDefinition] = field(default_factory=list)
    function_name: str | None = None  # the named function
    parallel: bool = True
    legacy: bool = False  # asked with `functions`: answer with `function_call`
    parser: type[ToolParser] | None = None  # for auto

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (`tools=`)."""
        if not self.functions:
            return None
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions]

    @property
    def constrains_output(self) -> bool:
        return self.mode in ("required", "named")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of `required` and named calls. Compact JSON: a call's spacing is nobody's
        concern, and free whitespace lets a small model spend its whole budget on blank lines."""
        if self.mode == "required":
            schema = required_calls_schema(self.functions, self.parallel)
        elif self.mode == "named":
            schema = next(f for f in self.functions if f.name == self.function_name).parameters or EMPTY_PARAMETERS
        else:
            return None
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    def new_parser(self) -> ToolParser | None:
        if self.mode == "required":
            return RequiredCallsParser()
        if self.mode == "named":
            return NamedCallParser(self.function_name or "")
        if self.mode == "auto" and self.parser is not None:
            return self.parser()
        return None

    @property
    def max_calls(self) -> int | None:
        return 1 if self.legacy or not self.parallel else None

    def extract(self, text: str) -> ExtractedToolCalls | None:
        """The calls in a finished output (None when tools do not apply)."""
        parser = self.new_parser()
        if parser is None:
            return None
        extracted = parser.extract(text)
        if self.max_calls is not None:
            extracted.calls = extracted.calls[: self.max_calls]
        return extracted

    def new_streamer(self) -> ToolCallStreamer | None:
        parser = self.new_parser()
        if parser is None:
            return None
        # A constrained output is calls or nothing: its text never turns into content.
        return ToolCallStreamer(parser.parse, self.max_calls, text_fallback=not self.constrains_output)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: `tool_calls` (`function_call` for the older API) when the model called tools
        and stopped on its own; a named function's call ends with `stop`."""
        if not called or reason != "stop" or self.mode == "named":
            return reason
        return "function_call" if self.legacy else "tool_calls"


def _named_choice(choice: dict[str, Any], param: str) -> str:
    usage = 'name one as {"type": "function", "function": {"name": "my_function"}}'
    function = choice.get("function") if param == "tool_choice" else choice
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise OpenAIError(f"Invalid `{param}`: {usage}.", param=param)
    return name


def plan_tools(request: ChatCompletionRequest, enable_auto_tool_choice: bool, tool_call_parser: str | None) -> ToolPlan:
    """The request's tool use, checked (a 400 names what is wrong)."""
    legacy = request.functions is not None or request.function_call is not None
    if legacy:
        functions = list(request.functions or [])
        choice: Any = request.function_call
        param = "function_call"
        if choice is not None and not functions:
            raise OpenAIError("When using `function_call`, `functions` must be set.", param=param)
    else:
        functions = [t.function for t in request.tools or []]
        choice = request.tool_choice
        param = "tool_choice"
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return ToolPlan("none", functions, legacy=legacy)
    if not functions:
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", param=param)
    plan = ToolPlan("none", functions, parallel=request.parallel_tool_calls is not False, legacy=legacy)
    if isinstance(choice, dict):
        plan.mode, plan.function_name = "named", _named_choice(choice, param)
        if plan.function_name not in {f.name for f in functions}:
            raise OpenAIError(f"The function {plan.function_name!r} in `{param}` is not one of the given tools.",
                              param=param)
    elif choice == "required" and not legacy:
        plan.mode = "required"
    elif choice == "auto":
        if not (enable_auto_tool_choice and tool_call_parser):
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              "set on the server.", param=param)
        plan.mode, plan.parser = "auto", TOOL_PARSERS[tool_call_parser]
    else:
        allowed = '"none", "auto" or a function name' if legacy else '"none", "auto", "required" or a named function'
        raise OpenAIError(f"Invalid `{param}` {choice!r}: use {allowed}.", param=param)
    return plan
