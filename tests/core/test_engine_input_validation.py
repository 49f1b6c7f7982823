"""The engine core checks what it receives: a malformed or out-of-range message on its socket is
refused (its sender told why, when it can be named) and the engine lives on, serving the rest.

Only the frontend validated requests before; a well-formed message with token id 10**9 on the
engine's socket aborted the engine process, and with it every request it held.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.core_client import AsyncMPClient, InprocClient
from compiled_llm.messages.engine_core import EngineCoreRequest, RequestType
from compiled_llm.sampling_params import SamplingParams

TIMEOUT = 60
INT64_MAX = 2**63 - 1


def config(model: str):
    return EngineArgs(model=model, optimization_level=0, max_model_len=256, max_num_seqs=8,
                      kv_cache_memory_bytes=32 << 20).create_engine_config()


def good_request(rid: str, max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 100, 200], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True), time.time())


def raw_add(rid: object, prompt: object, params: object) -> bytes:
    """An ADD message as any peer could write it: msgpack of whatever fields, unchecked."""
    return msgspec.msgpack.encode([rid, prompt, params, time.time(), 0])


async def outputs_until(client: AsyncMPClient, wanted: set[str]) -> dict[str, tuple[list[int], str, object]]:
    """Each wanted request's (tokens, finish reason, stop reason), once all of them finished."""
    seen: dict[str, tuple[list[int], str, object]] = {}
    tokens: dict[str, list[int]] = {}
    while not wanted <= set(seen):
        batch = await asyncio.wait_for(client.get_output_async(), TIMEOUT)
        for out in batch.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                seen[out.request_id] = (tokens[out.request_id], out.finish_reason, out.stop_reason)
    return {rid: seen[rid] for rid in wanted}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    client = AsyncMPClient(config(tiny_llama))
    loop = asyncio.new_event_loop()
    yield client, loop
    client.shutdown()
    loop.run_until_complete(asyncio.sleep(0))  # let the cancelled socket tasks finish
    loop.close()


def send_raw(client: AsyncMPClient, kind: RequestType, payload: bytes) -> None:
    client.input_socket.send_multipart([kind.value, payload])


def test_out_of_vocabulary_token_is_refused_and_the_engine_lives(engine):
    client, loop = engine

    async def main():
        params = msgspec.to_builtins(SamplingParams(max_tokens=2))
        send_raw(client, RequestType.ADD, raw_add("huge-id", [1, 10**9], params))
        send_raw(client, RequestType.ADD, raw_add("top-k", [1, 2], {"top_k": 2**64 - 1, "max_tokens": 2}))
        send_raw(client, RequestType.ADD, raw_add("no-prompt", [], params))
        send_raw(client, RequestType.ADD, raw_add("many-logprobs", [1, 2], {"logprobs": 10**6, "max_tokens": 2}))
        await client.add_request_async(good_request("fine"))
        return await outputs_until(client, {"huge-id", "top-k", "no-prompt", "many-logprobs", "fine"})

    results = loop.run_until_complete(main())
    assert results["huge-id"][1:] == ("error", "Token id 1000000000 is out of vocabulary (vocabulary size 49152).")
    assert results["top-k"][1] == "error" and "top_k" in results["top-k"][2]
    assert results["no-prompt"][1] == "error" and "empty" in results["no-prompt"][2]
    assert results["many-logprobs"][1] == "error" and "logprobs" in results["many-logprobs"][2]
    assert results["fine"][1] == "length" and len(results["fine"][0]) == 3
    assert client.proc.is_alive() and client.dead_error is None


def test_in_process_engine_refuses_with_a_named_problem(tiny_llama):
    core = InprocClient(config(tiny_llama))
    bad = EngineCoreRequest("x", [1, 10**9], SamplingParams(max_tokens=2), time.time())
    with pytest.raises(ValueError, match="out of vocabulary"):
        core.add_request(bad)
    too_long = EngineCoreRequest("y", [1] * 300, SamplingParams(max_tokens=2), time.time())
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request(too_long)
    assert not core.has_unfinished_requests()


# Anything a peer could put on the socket: junk bytes, msgpack of the wrong shape, and requests
# of the right shape with values of any size or type (msgpack holds integers in [-2**63, 2**64)).
junk_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
sampling_fields = st.fixed_dictionaries({}, optional={
    "n": junk_values | st.integers(-3, 3),
    "temperature": junk_values | st.floats(0, 2),
    "top_k": junk_values | st.integers(-(2**63), 2**64 - 1),
    "top_p": junk_values | st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "max_tokens": st.integers(-(2**63), 2**64 - 1) | junk_values,
    "min_tokens": st.integers(-5, 5),
    "logprobs": st.integers(-(2**63), 2**64 - 1),
    "stop_token_ids": st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3),
})
prompts = st.lists(st.integers(-(2**63), 2**64 - 1), max_size=6) | st.lists(st.integers(0, 60000), max_size=6) \
    | junk_values
add_messages = st.builds(lambda rid, prompt, params: raw_add(rid, prompt, params),
                         st.text(min_size=1, max_size=8), prompts, sampling_fields | junk_values)
messages = st.tuples(
    st.sampled_from([RequestType.ADD, RequestType.ABORT, RequestType.UTILITY]),
    add_messages | st.binary(max_size=64) | junk_values.map(msgspec.msgpack.encode),
) | st.tuples(st.just(b"\x09"), st.binary(max_size=16))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(messages, min_size=1, max_size=5))
def test_no_message_kills_the_engine(engine, batch):
    client, loop = engine
    for kind, payload in batch:
        frame = kind.value if isinstance(kind, RequestType) else kind
        client.input_socket.send_multipart([frame, payload])

    async def check() -> dict:
        # Requests that the engine took are aborted; a valid one sent after them still runs.
        for kind, payload in batch:
            if kind == RequestType.ADD:
                try:
                    rid = msgspec.msgpack.decode(payload)[0]
                except Exception:
                    continue
                if isinstance(rid, str):
                    await client.abort_requests_async([rid])
        rid = f"alive-{time.monotonic_ns()}"
        await client.add_request_async(good_request(rid, 1))
        return await outputs_until(client, {rid})

    results = loop.run_until_complete(check())
    assert next(iter(results.values()))[1] == "length", results
    assert client.proc.is_alive() and client.dead_error is None
