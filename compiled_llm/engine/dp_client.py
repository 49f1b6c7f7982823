"""Data parallelism: N engine cores, each a full copy of the model in its own process, behind one
frontend, which sends each request to one of them.

A request goes to the engine with the fewest requests in flight; but requests whose prompts start
the same (the same first KV blocks: a shared system prompt, the children of `n > 1`) go to the same
engine while its load stays within a small margin of the least loaded one, so that its prefix
cache serves them. Aborts go where their request went; utility calls go to every engine. The
engines' outputs arrive on one queue, each stamped with its engine's index. One engine's death
is the group's death, reported as a single engine's is.

With `--distributed-executor-backend ray` the engines are Ray actors in one placement group
(`ray_engine.py`), possibly on other nodes; otherwise local processes.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from typing import Any

from compiled_llm.config import EngineConfig
from compiled_llm.engine.core_client import AsyncMPClient, EngineDeadError
from compiled_llm.logger import init_logger
from compiled_llm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest

logger = init_logger(__name__)

# Blocks of the prompt that decide which engine a prefix belongs to.
_AFFINITY_BLOCKS = 2


class DPAsyncMPClient:
    def __init__(self, config: EngineConfig, engine_timeout_s: float = 120.0) -> None:
        size = config.parallel_config.data_parallel_size
        self.block_size = config.cache_config.block_size
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = asyncio.Queue()
        self.engines: list[AsyncMPClient] = []
        self._ray_group: Any = None
        try:
            handles: list[Any] = [None] * size
            if config.parallel_config.distributed_executor_backend == "ray":
                from compiled_llm.engine.ray_engine import RayEngineGroup

                self._ray_group = RayEngineGroup(config)
                handles = list(self._ray_group.engines)
            for index in range(size):  # all start at once; then wait for each
                self.engines.append(AsyncMPClient(config, engine_timeout_s, index, self._outputs, wait_ready=False,
                                                  engine=handles[index]))
            for engine in self.engines:
                engine.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._owner: dict[str, int] = {}  # request id -> engine index, while in flight
        self._round_robin = itertools.count()
        logger.info("Data parallel: %d engines behind this server.", size)

    # ---- the group's state -------------------------------------------------------------------
    @property
    def dead_error(self) -> EngineDeadError | None:
        return next((e.dead_error for e in self.engines if e.dead_error is not None), None)

    @property
    def pid(self) -> int | None:
        return self.engines[0].pid

    def mark_dead(self, error: EngineDeadError) -> None:
        for engine in self.engines:
            engine.mark_dead(error)

    async def wait_until_dead(self) -> EngineDeadError:
        waits = [asyncio.ensure_future(e.wait_until_dead()) for e in self.engines]
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        return next(iter(done)).result()

    def start(self) -> None:
        for engine in self.engines:
            engine.start()

    def expect_exit(self) -> None:
        for engine in self.engines:
            engine.expect_exit()

    async def get_output_async(self) -> EngineCoreOutputs:
        for engine in self.engines:
            engine.start()
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait(item)
            raise EngineDeadError(str(item))
        for out in item.outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return item

    # ---- routing ---------------------------------------------------------------------------
    def choose_engine(self, request: EngineCoreRequest) -> int:
        loads = [e.num_in_flight for e in self.engines]
        least = min(loads)
        ids = request.prompt_token_ids
        span = self.block_size * _AFFINITY_BLOCKS
        if len(ids) >= span:
            digest = hashlib.sha256(bytes(str(ids[:span]), "ascii")).digest()
            preferred = int.from_bytes(digest[:8], "little") % len(self.engines)
            if loads[preferred] <= least + max(2, least // 4):
                return preferred
        candidates = [i for i, load in enumerate(loads) if load == least]
        return candidates[next(self._round_robin) % len(candidates)]

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        index = self.choose_engine(request)
        self._owner[request.request_id] = index
        await self.engines[index].add_request_async(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            index = self._owner.pop(rid, None)
            if index is not None:
                by_engine.setdefault(index, []).append(rid)
        for index, ids in by_engine.items():
            await self.engines[index].abort_requests_async(ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Every engine's answer, as a list."""
        return list(await asyncio.gather(*(e.call_utility_async(method, *args) for e in self.engines)))

    async def reset_prefix_cache_async(self) -> bool:
        return all(await self.call_utility_async("reset_prefix_cache"))

    def shutdown(self) -> None:
        for engine in self.engines:  # all exit at once, then each is joined
            engine.request_shutdown()
        for engine in self.engines:
            engine.shutdown()
        if self._ray_group is not None:
            self._ray_group.stop()
