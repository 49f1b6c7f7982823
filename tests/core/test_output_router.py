"""`OutputRouter`: with several API server processes on one engine, every output reaches the
process that sent its request and no other, the scheduler stats reach process 0 alone, and a
process with nothing to receive still hears from the engine once a heartbeat."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_llm.core.core_proc import _client_frame, _salvage_id
from compiled_llm.core.output_router import OutputRouter
from compiled_llm.messages.engine_core import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    SchedulerStats,
    UtilityRequest,
)
from compiled_llm.sampling_params import SamplingParams


def step(outputs: list[EngineCoreOutput], stats: bool = True) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs, SchedulerStats(num_running_reqs=len(outputs)) if stats else None, 1.0)


def test_one_client_passes_every_message_through():
    router = OutputRouter(1)
    message = step([EngineCoreOutput("a", [1])])
    router.added("a", 0)
    assert router.route(message, now=0.0) == [(0, message)]
    assert len(router) == 0  # nothing to remember with one client


# Each step: the requests that get a token, and which of those finish.
steps = st.lists(st.tuples(st.sets(st.integers(0, 11)), st.sets(st.integers(0, 11))), min_size=1, max_size=8)


@settings(max_examples=80, deadline=None)
@given(num_clients=st.integers(2, 4), owners=st.lists(st.integers(0, 3), min_size=12, max_size=12), steps=steps,
       aborted=st.sets(st.integers(0, 11)))
def test_outputs_reach_exactly_their_senders(num_clients, owners, steps, aborted):
    router = OutputRouter(num_clients, heartbeat_s=1.0)
    owner = {f"r{i}": owners[i] % num_clients for i in range(12)}
    for rid, client in owner.items():
        router.added(rid, client)
    router.aborted([f"r{i}" for i in aborted])
    open_ids = set(owner) - {f"r{i}" for i in aborted}
    now = 0.0
    for tokens, finishing in steps:
        now += 0.1
        outs = [EngineCoreOutput(f"r{i}", [i], finish_reason="stop" if i in finishing else None)
                for i in sorted(tokens) if f"r{i}" in open_ids]
        routed = router.route(step(outs), now)
        clients = [client for client, _ in routed]
        assert len(clients) == len(set(clients))  # one message per client at most
        delivered = [(client, out.request_id) for client, message in routed for out in message.outputs]
        assert sorted(rid for _, rid in delivered) == sorted(o.request_id for o in outs)  # nothing lost or doubled
        assert all(owner[rid] == client for client, rid in delivered)
        assert [client for client, message in routed if message.scheduler_stats is not None] == [0]
        open_ids -= {o.request_id for o in outs if o.finished}
    assert len(router) == len(open_ids)  # finished and aborted requests are forgotten


def test_a_silent_client_hears_a_heartbeat():
    router = OutputRouter(3, heartbeat_s=1.0)
    router.added("a", 1)
    first = dict(router.route(step([EngineCoreOutput("a", [5])]), now=10.0))
    assert set(first) == {0, 1, 2}  # client 2 has never heard from the engine
    assert [o.request_id for o in first[1].outputs] == ["a"] and first[2].outputs == []
    second = dict(router.route(step([]), now=10.5))
    assert set(second) == {0}  # stats only; the others heard half a second ago
    third = dict(router.route(step([], stats=False), now=11.6))
    assert set(third) == {0, 1, 2}
    assert all(message.scheduler_stats is None for message in third.values())


def test_a_wrong_client_index_is_answered_through_client_0():
    router = OutputRouter(2)
    router.added("a", 7)
    routed = dict(router.route(step([EngineCoreOutput("a", [1], finish_reason="length")]), now=0.0))
    assert [o.request_id for o in routed[0].outputs] == ["a"]
    with pytest.raises(ValueError):
        OutputRouter(0)


def test_to_all():
    router = OutputRouter(3)
    dead = EngineCoreOutputs(engine_dead=True)
    assert router.to_all(dead) == [(0, dead), (1, dead), (2, dead)]


def test_a_malformed_message_is_answered_to_its_sender():
    """The input thread salvages the id and the client index of a message it cannot decode."""
    encoder = msgspec.msgpack.Encoder()
    request = msgspec.msgpack.decode(encoder.encode(EngineCoreRequest("req-1", [1, 2], SamplingParams(),
                                                                       client_index=2)))
    request[2] = "not sampling params"
    assert _salvage_id(RequestType.ADD, encoder.encode(request)) == ("req-1", 2)
    request = msgspec.msgpack.decode(encoder.encode(EngineCoreRequest("req-2", [1], SamplingParams())))
    request[1] = "not token ids"
    assert _salvage_id(RequestType.ADD, encoder.encode(request)) == ("req-2", 0)
    call = msgspec.msgpack.decode(encoder.encode(UtilityRequest(4, "ping", [], client_index=1)))
    call[2] = "not a list"
    assert _salvage_id(RequestType.UTILITY, encoder.encode(call)) == (4, 1)
    assert _salvage_id(RequestType.ADD, b"\xc1") is None


def test_a_client_aborts_only_its_own_requests():
    """A user-chosen id may be open on two API servers one after the other: an abort from one must
    not end the other's request."""
    router = OutputRouter(2)
    router.added("x", 1)
    assert router.owned(["x", "unknown"], 0) == []
    assert router.owned(["x", "unknown"], 1) == ["x"]
    assert OutputRouter(1).owned(["x"], 0) == ["x"]  # one client: the engine's own check suffices
    assert _client_frame([RequestType.ABORT.value, b"", b"3"]) == 3
    assert _client_frame([RequestType.ABORT.value, b""]) == 0
    assert _client_frame([RequestType.ABORT.value, b"", b"junk"]) == 0
