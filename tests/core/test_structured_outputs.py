"""Structured outputs end to end, offline `LLM` and the in-process engine: on the bundled model
every output of a JSON schema parses and validates, every regex output matches, every choice is
one of the choices and every grammar output is in the grammar, greedy and sampled; a bad
constraint is refused by the frontend and by the engine, which keeps serving; asynchronous
scheduling gives what synchronous scheduling gives; and a batch without constraints builds no
bitmask."""

from __future__ import annotations

import json
import re
import time

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.messages.engine_core import EngineCoreRequest
from compiled_llm.sampling_params import StructuredOutputsParams as SO

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
COLORS = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                      "minItems": 1, "maxItems": 3}},
          "required": ["colors"]}
ORDER = {"type": "object", "properties": {"item": {"type": "string", "enum": ["apple", "bread", "milk"]},
                                          "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "paid": {"type": "boolean"}},
         "required": ["item", "quantity", "paid"]}
SUM_GRAMMAR = 'root ::= "(" num " " op " " num ")"\nnum ::= [0-9] | [1-9] [0-9]\nop ::= "+" | "-" | "*"'
SUM_RE = r"\((?:[0-9]|[1-9][0-9]) [+\-*] (?:[0-9]|[1-9][0-9])\)"
EMAIL_RE = r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)"
PHONE_RE = r"[0-9]{3}-[0-9]{4}"


def check_person(value) -> None:
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120


def check_colors(value) -> None:
    assert set(value) == {"colors"} and 1 <= len(value["colors"]) <= 3
    assert all(isinstance(c, str) and len(c) <= 12 for c in value["colors"])


def check_order(value) -> None:
    assert set(value) == {"item", "quantity", "paid"} and value["item"] in ("apple", "bread", "milk")
    assert isinstance(value["quantity"], int) and 1 <= value["quantity"] <= 9 and isinstance(value["paid"], bool)


# (user message, constraint, check of the output text)
CASES = [
    ("Describe a person as JSON.", SO(json=PERSON), lambda text: check_person(json.loads(text))),
    ("List one to three colors as JSON.", SO(json=json.dumps(COLORS)), lambda text: check_colors(json.loads(text))),
    ("Order something from the shop as JSON.", SO(json=ORDER, disable_any_whitespace=True),
     lambda text: check_order(json.loads(text))),
    ('Answer with the JSON object {"answer": "hello"} and nothing else.', SO(json_object=True),
     lambda text: isinstance(json.loads(text), dict)),
    ("Write an email address.", SO(regex=EMAIL_RE), lambda text: re.fullmatch(EMAIL_RE, text)),
    ("Give a phone number.", SO(regex=PHONE_RE), lambda text: re.fullmatch(PHONE_RE, text)),
    ("What is the capital of France?", SO(choice=["Paris", "London", "Berlin"]),
     lambda text: text in ("Paris", "London", "Berlin")),
    ("Write a small sum.", SO(grammar=SUM_GRAMMAR), lambda text: re.fullmatch(SUM_RE, text)),
]


@pytest.fixture(scope="module")
def llm(real_model_path):
    return LLM(real_model_path, optimization_level=0, max_model_len=512, kv_cache_memory_bytes=64 << 20)


def chat(llm: LLM, message: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                   add_generation_prompt=True)


def test_constraints_hold_on_the_bundled_model_greedy_and_sampled(llm):
    prompts, params, checks = [], [], []
    for message, constraint, check in CASES:
        for temperature in (0.0, 0.8):
            prompts.append(chat(llm, message))
            # Any JSON object may run on: its cap keeps the batch's step count to the bounded cases'.
            max_tokens = 24 if constraint.json_object else 48
            params.append(SamplingParams(temperature=temperature, seed=3, max_tokens=max_tokens,
                                         structured_outputs=constraint))
            checks.append(check)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.llm_engine.engine_core
    for out, param, check in zip(outputs, params, checks):
        completion = out.outputs[0]
        where = f"{param.structured_outputs} at temperature {param.temperature}: {completion.text!r}"
        if completion.finish_reason == "length" and param.structured_outputs.json_object:
            # Any JSON object has no length bound: a cut one must still be a prefix of one.
            assert in_grammar_prefix(core, param.structured_outputs, completion.text), where
            continue
        assert completion.finish_reason == "stop", where  # the grammar was complete, and then only EOS was allowed
        assert check(completion.text) is not False, where
    assert core.structured_outputs is not None and len(core.structured_outputs) == 0
    # One compilation per distinct constraint, not per request.
    assert core.structured_outputs.compilers.num_compilations == len(CASES)


def in_grammar_prefix(core, constraint: SO, text: str) -> bool:
    import xgrammar as xgr

    from compiled_llm.structured_output_spec import grammar_spec

    compiled = core.structured_outputs.compilers.compile(grammar_spec(constraint)).future.result(timeout=60)
    return xgr.GrammarMatcher(compiled).accept_string(text)


def test_a_bad_constraint_is_refused_before_the_engine_and_by_it(llm):
    with pytest.raises(ValueError, match="Invalid structured outputs regex"):
        llm.generate(["Hi"], SamplingParams(structured_outputs=SO(regex="(unclosed")), use_tqdm=False)
    with pytest.raises(ValueError, match="Unsupported type"):
        llm.generate(["Hi"], SamplingParams(structured_outputs=SO(json={"type": "objec"})), use_tqdm=False)
    # Past the frontend (a peer writing to the engine's socket): the engine parses it off its step
    # loop, ends the request with the reason, and lives on.
    core = llm.llm_engine.engine_core
    bad = EngineCoreRequest("bad", [1, 2, 3], SamplingParams(structured_outputs=SO(grammar="root ::= nothing")),
                            time.time())
    core.add_request(bad)
    deadline = time.monotonic() + 30
    while not (refused := [o for o in core.step().outputs if o.request_id == "bad"]):
        assert time.monotonic() < deadline
    assert refused[0].finish_reason == "error" and 'Rule "nothing" is not defined' in refused[0].stop_reason
    assert not core.has_unfinished_requests()
    with pytest.raises(ValueError, match="not valid JSON"):  # what needs no grammar engine is refused at once
        core.add_request(EngineCoreRequest("bad2", [1], SamplingParams(structured_outputs=SO(json="{")), time.time()))
    out = llm.generate(["Yes or no?"], SamplingParams(max_tokens=4, structured_outputs=SO(choice=["yes", "no"])),
                       use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")


def test_a_grammar_compiling_past_the_time_limit_ends_its_request_and_no_other(llm, monkeypatch):
    """The bound on what the depth limit does not catch: a compilation that runs past the limit
    ends its request with an error naming it, while a plain request is served meanwhile."""
    from compiled_llm.core.structured_outputs import manager

    monkeypatch.setattr(manager, "GRAMMAR_TIME_LIMIT_S", 0.0)
    core = llm.llm_engine.engine_core
    deep = {"type": "string"}
    for _ in range(28):  # 40 chains of 28 nested objects: about half a second to compile
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    costly = {"type": "object", "properties": {f"p{i}": deep for i in range(40)}}
    core.add_request(EngineCoreRequest("slow", [1, 2, 3], SamplingParams(structured_outputs=SO(json=costly)),
                                       time.time()))
    core.add_request(EngineCoreRequest("plain", [1, 2, 3], SamplingParams(max_tokens=2), time.time()))
    outputs: dict[str, list] = {}
    deadline = time.monotonic() + 60
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in core.step().outputs:
            outputs.setdefault(out.request_id, []).append(out)
    slow, plain = outputs["slow"][-1], outputs["plain"][-1]
    assert slow.finish_reason == "error" and "longer than 0 s to compile" in slow.stop_reason
    assert plain.finish_reason == "length"


def test_ids_and_aborts_while_a_grammar_compiles(llm):
    core = llm.llm_engine.engine_core
    constrained = SamplingParams(structured_outputs=SO(regex="[a-z]{1,3} ?"))
    waiting = EngineCoreRequest("w", [1, 2, 3], constrained, time.time())
    core.add_request(waiting)  # waits for its grammar (nothing steps it here)
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(EngineCoreRequest("w", [1, 2], SamplingParams(), time.time()))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(waiting)
    core.abort_requests(["w"])
    assert not core.has_unfinished_requests()


@pytest.fixture(scope="module", params=[16 << 20, 9 * 8192], ids=["roomy", "preempting"])
def tiny_runs(request, tiny_llama):
    """The same mixed batch (constrained and not, greedy and seeded, logit_bias, prompt logprobs,
    scoring only) through a synchronous and an asynchronous engine on a tiny random model, with
    room for all, or with 8 KV blocks (8 KiB each, 16 tokens) so that requests are preempted."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SO(choice=["alpha", "beta", "gamma"])),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, structured_outputs=SO(json=PERSON)),
        SamplingParams(temperature=0.0, max_tokens=16),
        SamplingParams(temperature=0.9, seed=9, max_tokens=10, structured_outputs=SO(regex=PHONE_RE), logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=14, logit_bias={100: 5.0, 200: -100.0}, prompt_logprobs=3),
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True,
                       structured_outputs=SO(grammar=SUM_GRAMMAR)),
        SamplingParams(max_tokens=0, prompt_logprobs=2),
    ]
    prompts = [f"Prompt number {i}: tell me something" + " more" * (18 + i) for i in range(len(params))]
    runs = {}
    for mode in (False, True):
        llm = LLM(tiny_llama, optimization_level=0, max_model_len=128, kv_cache_memory_bytes=request.param,
                  max_num_seqs=4, async_scheduling=mode)
        outs = llm.generate(prompts, params, use_tqdm=False)
        core = llm.llm_engine.engine_core
        assert not core.has_unfinished_requests()
        pool = core.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks - 1, "blocks leaked"
        if request.param < 1 << 20:
            assert core.scheduler.num_preemptions > 0
        runs[mode] = [
            (c.token_ids, c.text, c.finish_reason, [sorted(d) for d in c.logprobs or []],
             [None if d is None else {t: round(lp.logprob, 3) for t, lp in d.items()} for d in o.prompt_logprobs or []])
            for o in outs for c in o.outputs
        ]
    return runs


def test_async_scheduling_equals_sync_with_constraints(tiny_runs):
    assert tiny_runs[True] == tiny_runs[False]
    sync = tiny_runs[False]
    # Random weights, yet every constrained output is in its language, and a finished grammar
    # ends its request even with ignore_eos.
    assert sync[0][1] in ("alpha", "beta", "gamma") and sync[0][2] == "stop"
    assert re.fullmatch(PHONE_RE, sync[3][1]) and sync[3][2] == "stop"
    assert re.fullmatch(SUM_RE, sync[5][1]) and sync[5][2] == "stop"
    assert 200 not in sync[4][0]
    assert sync[4][4][0] is None and len(sync[4][4]) > 1
    assert sync[6][0] == [] and sync[6][2] == "length" and len(sync[6][4]) > 1  # scored, nothing generated


def test_an_unconstrained_batch_builds_no_bitmask(tiny_llama):
    llm = LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    llm.generate(["plain text", "more plain text"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    core = llm.llm_engine.engine_core
    assert core.structured_outputs is None  # no grammar machinery exists at all
    assert core.executor.driver.num_grammar_bitmasks == 0
    # In a mixed batch, only the steps that sample the constrained request apply a bitmask.
    outs = llm.generate(["plain", "constrained"], [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=SO(choice=["ab", "cd"])),
    ], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 10
    assert core.executor.driver.num_grammar_bitmasks == len(outs[1].outputs[0].token_ids) < 10
