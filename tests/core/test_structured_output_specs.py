"""Structured outputs' constraints before any model runs: one canonical spec per constraint (the
grammar cache's key), a clear ValueError for what xgrammar cannot parse or enforce, choice lists
whose grammar accepts exactly the choices, and one compilation per distinct spec."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_llm.core.structured_outputs import GrammarCompilerPool
from compiled_llm.sampling_params import SamplingParams
from compiled_llm.sampling_params import StructuredOutputsParams as SO
from compiled_llm.structured_output_spec import grammar_spec, validate_structured_outputs

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def compilers(real_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    pool = GrammarCompilerPool(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield pool
    pool.shutdown()


def test_one_spec_per_schema_whatever_its_spelling():
    as_dict = grammar_spec(SO(json=PERSON))
    as_text = grammar_spec(SO(json=json.dumps(PERSON, indent=4)))
    assert as_dict == as_text and hash(as_dict) == hash(as_text)
    # Key order is the order of the output's properties: another order is another grammar.
    reordered = dict(PERSON, properties={"age": {"type": "integer"}, "name": {"type": "string"}})
    assert grammar_spec(SO(json=reordered)) != as_dict
    assert grammar_spec(SO(json=PERSON, disable_any_whitespace=True)) != as_dict
    assert grammar_spec(SO(choice=["a", "b"])).kind == "grammar"
    assert validate_structured_outputs(SamplingParams()) is None


@pytest.mark.parametrize(
    "params, words",
    [
        (SO(json='{"type": "object", '), "not valid JSON"),
        (SO(json={"type": "objec"}), "Unsupported type"),
        (SO(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}), "Missing"),
        (SO(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (SO(json={"type": "string", "pattern": "a+", "maxLength": 3}), "minLength/maxLength"),
        (SO(regex="(abc"), "parenthesis is not closed"),
        (SO(regex="a\x00b"), "NUL"),
        (SO(grammar="root ::= foo"), 'Rule "foo" is not defined'),
        (SO(grammar='start ::= "a"'), 'root rule with name "root" is not found'),
    ],
    ids=["json-text", "json-type", "json-ref", "unique-items", "pattern-length", "regex", "nul", "ebnf-rule",
         "ebnf-root"],
)
def test_a_bad_constraint_is_a_value_error_naming_the_problem(params, words):
    with pytest.raises(ValueError, match="structured outputs|JSON schema") as error:
        validate_structured_outputs(params)
    assert words in str(error.value)
    assert "/project/cpp" not in str(error.value)  # xgrammar's source positions are stripped


def test_a_property_named_like_an_unenforced_keyword_is_fine():
    schema = {"type": "object", "properties": {"contains": {"type": "string"}, "uniqueItems": {"type": "integer"}},
              "default": {"uniqueItems": True}}
    assert validate_structured_outputs(SO(json=schema)).kind == "json"


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="non-empty list"):
        SO(choice=[])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(min_size=1, max_size=12).filter(lambda s: "\x00" not in s), min_size=1, max_size=5,
                unique=True))
def test_a_choice_grammar_accepts_exactly_its_choices(compilers, choices):
    import xgrammar as xgr

    compiled = compilers.compile(validate_structured_outputs(SO(choice=choices))).future.result(timeout=60)
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    longer = max(choices, key=len) + "\x01"
    matcher = xgr.GrammarMatcher(compiled)
    assert not (matcher.accept_string(longer) and matcher.is_completed())


def test_each_distinct_spec_compiles_once(compilers):
    before = compilers.num_compilations
    specs = [grammar_spec(SO(json=PERSON)), grammar_spec(SO(json=json.dumps(PERSON))), grammar_spec(SO(regex="[0-9]+")),
             grammar_spec(SO(regex="[0-9]+")), grammar_spec(SO(json_object=True))]
    jobs = [compilers.compile(spec) for spec in specs]
    assert jobs[0] is jobs[1] and jobs[2] is jobs[3]  # shared while compiling, too
    for job in jobs:
        job.future.result(timeout=60)
    assert compilers.num_compilations - before == 3


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_schema_nested_past_the_limit_is_refused_before_xgrammar_parses_it():
    """Issue 21: 400 nested objects took xgrammar 12 s to parse and as long again to compile."""
    from compiled_llm.structured_output_spec import MAX_JSON_SCHEMA_DEPTH

    assert validate_structured_outputs(SO(json=nested_objects(MAX_JSON_SCHEMA_DEPTH - 1))) is not None
    for depth in (MAX_JSON_SCHEMA_DEPTH + 1, 400):
        with pytest.raises(ValueError, match=f"more than {MAX_JSON_SCHEMA_DEPTH} levels deep"):
            validate_structured_outputs(SO(json=nested_objects(depth)))
    deep_items = {"type": "array", "items": nested_objects(MAX_JSON_SCHEMA_DEPTH)}
    with pytest.raises(ValueError, match="levels deep"):
        validate_structured_outputs(SO(json=deep_items))
