"""Which API server process gets which engine output, when several share one engine core
(`serve --api-server-count N`).

Each request's outputs go back to the process that sent it (`EngineCoreRequest.client_index`).
The scheduler's stats go to process 0 alone: its /metrics series for the engine (queue lengths,
KV-cache usage, prefix-cache and preemption counters) are then counted once, not N times, when
the processes' metrics are summed. A process that has nothing to receive still hears from the
engine once every `heartbeat_s`, so that its requests waiting in the queue behind the others'
never look like a hung engine to it (its client declares the engine dead after a silence).

With one process the router passes every message through unchanged.
"""

from __future__ import annotations

from compiled_llm.messages.engine_core import EngineCoreOutput, EngineCoreOutputs

HEARTBEAT_S = 1.0


class OutputRouter:
    def __init__(self, num_clients: int, heartbeat_s: float = HEARTBEAT_S) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.num_clients = num_clients
        self.heartbeat_s = heartbeat_s
        self._client_of: dict[str, int] = {}  # open request id -> the process that sent it
        self._last_sent = [float("-inf")] * num_clients

    def __len__(self) -> int:
        return len(self._client_of)

    def added(self, request_id: str, client: int) -> None:
        """The engine accepted a request from `client`."""
        if self.num_clients > 1:
            self._client_of[request_id] = self.check_client(client)

    def owned(self, request_ids: list[str], client: int) -> list[str]:
        """Those of `request_ids` that `client` sent: a client aborts only its own requests (an id
        chosen by a user may be open on another client)."""
        if self.num_clients == 1:
            return request_ids
        return [request_id for request_id in request_ids if self._client_of.get(request_id) == client]

    def aborted(self, request_ids: list[str]) -> None:
        """Aborted requests end without an output: forget them."""
        if self.num_clients > 1:
            for request_id in request_ids:
                self._client_of.pop(request_id, None)

    def check_client(self, client: int) -> int:
        """A message's client index, or 0 (with a wrong index the sender still gets an answer
        from somewhere rather than a crash)."""
        return client if 0 <= client < self.num_clients else 0

    def route(self, outputs: EngineCoreOutputs, now: float) -> list[tuple[int, EngineCoreOutputs]]:
        """One step's outputs as (client, message) pairs; `now`: a monotonic clock's reading."""
        if self.num_clients == 1:
            return [(0, outputs)]
        per_client: list[list[EngineCoreOutput]] = [[] for _ in range(self.num_clients)]
        for out in outputs.outputs:
            if out.finished:
                client = self._client_of.pop(out.request_id, 0)
            else:
                client = self._client_of.get(out.request_id, 0)
            per_client[client].append(out)
        routed = []
        for client, outs in enumerate(per_client):
            stats = outputs.scheduler_stats if client == 0 else None
            if outs or stats is not None or now - self._last_sent[client] >= self.heartbeat_s:
                routed.append((client, EngineCoreOutputs(outs, stats, outputs.timestamp,
                                                         engine_index=outputs.engine_index)))
                self._last_sent[client] = now
        return routed

    def to_all(self, outputs: EngineCoreOutputs) -> list[tuple[int, EngineCoreOutputs]]:
        """The same message for every process (the engine's death)."""
        return [(client, outputs) for client in range(self.num_clients)]
