"""Streamed events encoded from dicts by msgspec are byte for byte what the pydantic response models
dump, for every kind of chunk a stream sends (Hypothesis over their contents)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatLogProbsTop,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    LogprobInfo,
    PromptTokensDetails,
    UsageInfo,
)
from compiled_llm.entrypoints.openai.serving_engine import sse
from compiled_llm.entrypoints.openai.stream_events import (
    chat_choice,
    chat_chunk,
    completion_choice,
    completion_chunk,
    content_delta,
    reasoning_delta,
)

# Model output: any text a tokenizer can decode (no lone surrogates), control characters included.
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
finish_reasons = st.sampled_from([None, "stop", "length", "tool_calls"])
stop_reasons = st.one_of(st.none(), st.integers(0, 2**31), texts)
token_ids = st.one_of(st.none(), st.lists(st.integers(0, 2**31), max_size=4))
# The models refuse infinities (the logprobs code floors -inf to a finite value), so finite floats.
logprob_values = st.floats(allow_nan=False, allow_infinity=False, max_value=0.0)
usages = st.one_of(st.none(), st.builds(
    UsageInfo, prompt_tokens=st.integers(0, 10**6), completion_tokens=st.integers(0, 10**6),
    total_tokens=st.integers(0, 10**6), prompt_tokens_details=st.one_of(st.none(), st.builds(
        PromptTokensDetails, cached_tokens=st.integers(0, 10**6))),
))
chat_tops = st.builds(ChatLogProbsTop, token=texts, logprob=logprob_values,
                      bytes=st.one_of(st.none(), st.lists(st.integers(0, 255), max_size=4)))
chat_logprobs = st.one_of(st.none(), st.builds(ChatLogProbs, content=st.lists(st.builds(
    ChatLogProbsContent, token=texts, logprob=logprob_values, bytes=st.none(),
    top_logprobs=st.lists(chat_tops, max_size=2)), max_size=2)))
tool_deltas = st.lists(st.builds(
    DeltaToolCall, index=st.integers(0, 3), id=st.one_of(st.none(), texts),
    type=st.sampled_from([None, "function"]),
    function=st.builds(DeltaFunctionCall, name=st.one_of(st.none(), texts), arguments=st.one_of(st.none(), texts)),
), min_size=1, max_size=2)


@settings(max_examples=200, deadline=None)
@given(
    content=st.one_of(st.none(), texts), role=st.sampled_from([None, "assistant"]), tools=st.one_of(
        st.none(), tool_deltas), index=st.integers(0, 127), logprobs=chat_logprobs, finish_reason=finish_reasons,
    stop_reason=stop_reasons, ids=token_ids, usage=usages, prompt_ids=token_ids,
    prompt_text=st.one_of(st.none(), texts), created=st.integers(0, 2**40),
)
def test_chat_chunks_match_the_pydantic_model(content, role, tools, index, logprobs, finish_reason, stop_reason, ids,
                                              usage, prompt_ids, prompt_text, created):
    model_delta = DeltaMessage(role=role, content=content, tool_calls=tools)
    expected = sse(ChatCompletionChunk(
        id="chatcmpl-1", created=created, model="m", usage=usage, prompt_token_ids=prompt_ids,
        prompt_text=prompt_text, choices=[ChatCompletionStreamChoice(
            index=index, delta=model_delta, logprobs=logprobs, finish_reason=finish_reason,
            stop_reason=stop_reason, token_ids=ids)],
    ))
    delta = content_delta(content, role) if tools is None else model_delta  # the two kinds a stream sends
    got = chat_chunk("chatcmpl-1", created, "m", [chat_choice(index, delta, logprobs, finish_reason, stop_reason, ids)],
                     usage, prompt_ids, prompt_text)
    assert got == expected


@settings(max_examples=100, deadline=None)
@given(reasoning=texts.filter(bool), role=st.sampled_from([None, "assistant"]), index=st.integers(0, 127))
def test_reasoning_deltas_match_the_pydantic_model(reasoning, role, index):
    model_delta = DeltaMessage(role=role, reasoning=reasoning, reasoning_content=reasoning)
    expected = sse(ChatCompletionChunk(id="chatcmpl-1", created=0, model="m", choices=[
        ChatCompletionStreamChoice(index=index, delta=model_delta)]))
    assert chat_chunk("chatcmpl-1", 0, "m", [chat_choice(index, reasoning_delta(reasoning, role))]) == expected


@settings(max_examples=200, deadline=None)
@given(
    text=texts, index=st.integers(0, 127), finish_reason=finish_reasons, stop_reason=stop_reasons, ids=token_ids,
    prompt_ids=token_ids, usage=usages, created=st.integers(0, 2**40), with_logprobs=st.booleans(),
    values=st.lists(logprob_values, max_size=3),
    prompt_logprobs=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.dictionaries(
        st.integers(0, 1000).map(str), st.builds(LogprobInfo, logprob=logprob_values, rank=st.one_of(
            st.none(), st.integers(1, 20)), decoded_token=st.one_of(st.none(), texts)), max_size=2)), max_size=3)),
    no_choice=st.booleans(),
)
def test_completion_chunks_match_the_pydantic_model(text, index, finish_reason, stop_reason, ids, prompt_ids, usage,
                                                    created, with_logprobs, values, prompt_logprobs, no_choice):
    logprobs = CompletionLogProbs(text_offset=list(range(len(values))), token_logprobs=values,
                                  tokens=["t"] * len(values), top_logprobs=[{"t": v} for v in values]) \
        if with_logprobs else None
    fields = completion_choice(index, text, logprobs, finish_reason, stop_reason, ids, prompt_ids, prompt_logprobs)
    expected = sse(CompletionResponse(id="cmpl-1", created=created, model="m", usage=usage,
                                      choices=[] if no_choice else [CompletionResponseChoice(**fields)]))
    assert completion_chunk("cmpl-1", created, "m", [] if no_choice else [fields], usage) == expected
