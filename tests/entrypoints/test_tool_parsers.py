"""Tool-call parsers on crafted model outputs, whole and streamed in every split: a stream's
deltas must add up to the whole response's content and calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.entrypoints.cli import build_parser
from compiled_llm.entrypoints.openai.chat_tools import NamedCallParser, RequiredCallsParser, required_calls_schema
from compiled_llm.entrypoints.openai.protocol import FunctionDefinition
from compiled_llm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallStreamer
from compiled_llm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from compiled_llm.entrypoints.openai.tool_parsers.xlam import XLAMToolParser

WEATHER = {"city": "Paris", "days": [1, 2], "note": "say \"hi\" } ]"}
HERMES_TWO_CALLS = (
    "Let me look that up.\n<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": WEATHER})
    + "\n</tool_call>\n<tool_call>"
    + json.dumps({"name": "get_time", "arguments": {}})
    + "</tool_call>"
)
XLAM_CALLS = "<tool_call>[" + json.dumps({"name": "get_weather", "arguments": WEATHER}) + ", " \
    + json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}}) + "]</tool_call>"

# (parser, text, content, [(name, arguments)])
CASES = [
    (HermesToolParser, HERMES_TWO_CALLS, "Let me look that up.\n", [("get_weather", WEATHER), ("get_time", {})]),
    (HermesToolParser, "No tools needed: 1 < 2 and <tool is not a tag.", "whole", []),
    # The model stopped (end of sequence) before the closing tag: the call still counts.
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),
    # Arguments sent as JSON text inside a string, and a call without arguments.
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', None, [("f", {"x": 2})]),
    (HermesToolParser, '<tool_call>{"name": "g"}</tool_call>', None, [("g", {})]),
    # Broken JSON: no call was made, all of it is content.
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"x": }</tool_call>', "whole", []),
    (XLAMToolParser, XLAM_CALLS, None, [("get_weather", WEATHER), ("add", {"a": 1, "b": 2})]),
    (XLAMToolParser, ' [{"name": "f", "arguments": {"q": "a]b"}}]', None, [("f", {"q": "a]b"})]),
    (XLAMToolParser, 'Sure.\n```json\n[{"name": "f", "arguments": {}}]\n```', "Sure.\n", [("f", {})]),
    (XLAMToolParser, "[1, 2, 3] are numbers", "whole", []),
    (XLAMToolParser, "Plain text with a [bracket].", "whole", []),
]


def _calls(extracted) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.calls]


@pytest.mark.parametrize("parser_class,text,content,calls", CASES)
def test_whole_outputs(parser_class, text, content, calls):
    extracted = parser_class().extract(text)
    assert _calls(extracted) == calls
    assert extracted.content == (text if content == "whole" else content)


def _streamed(parser_class, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    streamer = ToolCallStreamer(parser_class().parse)
    content, calls = "", []
    bounds = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    for end in bounds:
        piece, deltas = streamer.update(text[:end], end == len(text))
        content += piece
        for d in deltas:
            if d.id is not None:  # a call's first delta carries its id and name
                assert d.index == len(calls) and d.name
                calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
            else:
                calls[d.index]["arguments"] += d.arguments
    return content, calls


# A call whose JSON breaks after its name was streamed cannot be taken back: streams are compared
# for outputs that are calls or that never look like one.
STREAMABLE = [case for case in CASES if "x\": }" not in case[1]]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(STREAMABLE), cuts=st.lists(st.integers(0, 400), max_size=40))
def test_streams_add_up_to_the_whole(case, cuts):
    parser_class, text, content, calls = case
    streamed_content, streamed_calls = _streamed(parser_class, text, cuts)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls
    assert len({c["id"] for c in streamed_calls}) == len(calls)
    whole = parser_class().extract(text)
    assert streamed_content == (whole.content or "") or (not calls and streamed_content == text)


def test_streaming_holds_back_a_tag_that_may_be_opening():
    streamer = ToolCallStreamer(HermesToolParser().parse)
    assert streamer.update("Hi <tool_", final=False) == ("Hi ", [])
    content, deltas = streamer.update('Hi <tool_call>{"name": "f", "arg', final=False)
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("f", "")]
    content, deltas = streamer.update('Hi <tool_call>{"name": "f", "arguments": {"a": "b', final=False)
    assert deltas[0].arguments == '{"a": "b' and deltas[0].id is None
    # A held-back prefix that never became a tag is content in the end.
    plain = ToolCallStreamer(HermesToolParser().parse)
    assert plain.update("a <tool", final=False)[0] == "a "
    assert plain.update("a <tool", final=True)[0] == "<tool"


def test_parallel_tool_calls_false_keeps_the_first():
    streamer = ToolCallStreamer(HermesToolParser().parse, max_calls=1)
    _, deltas = streamer.update(HERMES_TWO_CALLS, final=True)
    assert {d.index for d in deltas} == {0}


def test_required_and_named_outputs():
    required = RequiredCallsParser().extract('[{"name":"add","arguments":{"a":1,"b":2}},{"name":"f","arguments":{}}]')
    assert _calls(required) == [("add", {"a": 1, "b": 2}), ("f", {})] and required.content == ""
    named = NamedCallParser("add").extract(' {"a": 1} ')
    assert _calls(named) == [("add", {"a": 1})] and named.content == ""
    # Cut short (max_tokens): no call, and the unfinished JSON is no content either.
    for parser, text in ((RequiredCallsParser(), '[{"name":"add","argu'), (NamedCallParser("add"), '{"a": ')):
        cut = parser.extract(text)
        assert cut.calls == [] and cut.content == ""
        streamer = ToolCallStreamer(parser.parse, text_fallback=False)
        content, _ = streamer.update(text, final=True)
        assert content == ""
    streamer = ToolCallStreamer(NamedCallParser("add").parse)
    _, first = streamer.update('{"a"', final=False)
    _, rest = streamer.update('{"a": 1}', final=True)
    assert first[0].name == "add" and first[0].arguments + rest[0].arguments == '{"a": 1}'


def test_required_schema_hoists_definitions():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    functions = [
        FunctionDefinition(name="move", parameters={"type": "object", "properties": {"to": {"$ref": "#/$defs/P"}},
                                                    "$defs": {"P": point}}),
        FunctionDefinition(name="stop"),
    ]
    schema = required_calls_schema(functions, parallel=False)
    assert schema["$defs"] == {"P": point} and schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["move"], ["stop"]]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["arguments"]


def test_cli_offers_every_parser():
    parser = build_parser()
    for name in TOOL_PARSERS:
        assert parser.parse_args(["serve", "--tool-call-parser", name]).tool_call_parser == name
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "nonexistent"])
