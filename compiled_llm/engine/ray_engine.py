"""The engines of a data-parallel group as Ray actors (`--data-parallel-size N
--distributed-executor-backend ray`), so that one server's engines may sit on several nodes.

One placement group holds one bundle per engine (its CPUs, `num_threads`, or one GPU), packed onto
as few nodes as have room; Ray spreads them when one node has none. Every node must see the model
folder and the compile cache at the same paths (shared storage, or the same files).

The frontend reaches each engine over ZeroMQ tcp: the engine binds its input socket to its own
node's address, the frontend binds its output socket to the driver node's address (never
0.0.0.0), and both sides decode msgpack into known msgspec types only (see `core/core_actor.py`).
`RAY_ADDRESS` picks the cluster (else a local Ray instance is started). When the driver goes, Ray
ends the actors it owns, so a forgotten group leaves nothing behind.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from compiled_llm.config import EngineConfig
from compiled_llm.core.core_actor import EngineCoreActor
from compiled_llm.engine.engine_process import EngineStartupError
from compiled_llm.logger import init_logger
from compiled_llm.messages.engine_core import Handshake
from compiled_llm.utils import import_ray

logger = init_logger(__name__)

_PLACEMENT_TIMEOUT_S = 300
_WATCH_S = 1.0  # how often the watcher thread looks whether it should stop


class RayEngine:
    """One engine actor, as an `EngineHandle` for `AsyncMPClient`.

    Readiness is `start()`'s result (the `Handshake`). Death is the end of `run()`, a call that
    lasts as long as the engine: a thread waits on it and then closes a pipe, whose read end is the
    `sentinel` the client's poller watches, so a dead actor reaches the same `mark_dead` path as a
    dead process."""

    owns_engine = True

    def __init__(self, ray: Any, actor: Any, config: EngineConfig, engine_index: int, where: tuple[str, str, int],
                 frontend_ip: str) -> None:
        self._ray = ray
        self.actor = actor
        self._config = config
        self.engine_index = engine_index
        self.input_address, self.node_id, self._pid = where
        self.output_bind_address = f"tcp://{frontend_ip}:*"
        self.sentinel, self._write_end = os.pipe()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._ready_ref: Any = None
        self._run_ref: Any = None
        self._exit: str | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    def start(self, output_address: str) -> None:
        self._ready_ref = self.actor.start.remote(self._config, output_address)
        self._run_ref = self.actor.run.remote()  # queued behind start: an actor runs one call at a time
        threading.Thread(target=self._watch, name=f"RayEngineWatch{self.engine_index}", daemon=True).start()

    def wait_ready(self) -> Handshake:
        try:
            handshake = self._ray.get(self._ready_ref)
        except self._ray.exceptions.RayError as e:
            raise EngineStartupError(f"The engine core's Ray actor {self.engine_index} died during start-up: "
                                     f"{_first_line(e)}") from None
        if not handshake.ok:
            raise EngineStartupError(f"The engine core failed to start: {handshake.error}")
        return handshake

    def _watch(self) -> None:
        try:
            while not self._stopping.is_set():
                done, _ = self._ray.wait([self._run_ref], timeout=_WATCH_S)
                if done:
                    break
            else:
                return
            try:
                code = self._ray.get(self._run_ref)
                self._exit = f"The engine core actor {self.engine_index} exited unexpectedly (exit code {code})."
            except Exception as e:
                self._exit = f"The engine core's Ray actor {self.engine_index} died: {_first_line(e)}"
        except Exception as e:  # Ray itself went away (shutdown at exit): nothing left to watch
            self._exit = f"Lost Ray while watching engine core actor {self.engine_index}: {_first_line(e)}"
        finally:
            self._close_write_end()

    def _close_write_end(self) -> None:
        with self._lock:
            if self._write_end >= 0:
                os.close(self._write_end)
                self._write_end = -1

    def is_alive(self) -> bool:
        return self._run_ref is not None and self._exit is None and not self._stopping.is_set()

    def join(self, timeout: float) -> None:
        if self._run_ref is not None and self._ray.is_initialized():
            self._ray.wait([self._run_ref], timeout=timeout)

    def describe_exit(self) -> str:
        return self._exit or f"The engine core actor {self.engine_index} is gone."

    def kill(self) -> None:
        if self._ray.is_initialized():
            self._ray.kill(self.actor, no_restart=True)

    def stop(self) -> None:
        """Kill the actor (after a SHUTDOWN it has already left its loop) and close the pipe."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self.kill()
        except Exception:  # already gone, or Ray already shut down
            pass
        self._close_write_end()
        os.close(self.sentinel)


class RayEngineGroup:
    """The placement group and the engine actors of one data-parallel group."""

    def __init__(self, config: EngineConfig) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel = config.parallel_config
        if parallel.tensor_parallel_size > 1:  # also refused by ParallelConfig; kept for direct callers
            raise ValueError("tensor_parallel_size > 1 inside data-parallel engines on Ray is not supported.")
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
        self._ray = ray
        self.engines: list[RayEngine] = []
        self._placement: Any = None
        size = parallel.data_parallel_size
        on_gpu = config.torch_device.type == "cuda"
        threads = config.num_threads or 1
        bundle = {"GPU": 1} if on_gpu else {"CPU": threads}
        self._placement = placement_group([bundle] * size, strategy="PACK")
        try:
            ray.get(self._placement.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.stop()
            raise EngineStartupError(
                f"Ray could not place {size} engines of {bundle} each within {_PLACEMENT_TIMEOUT_S} s; the cluster "
                f"has {ray.cluster_resources()}. Lower --data-parallel-size or --num-threads, or add nodes."
            ) from None
        actor_class = ray.remote(num_cpus=0 if on_gpu else threads, num_gpus=1 if on_gpu else 0)(EngineCoreActor)
        env = {k: v for k, v in os.environ.items() if k.startswith("COMPILED_LLM_")}
        actors = [
            actor_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement, placement_group_bundle_index=i),
                runtime_env={"env_vars": env},
            ).remote(i)
            for i in range(size)
        ]
        try:
            wheres = ray.get([a.where.remote() for a in actors], timeout=_PLACEMENT_TIMEOUT_S)
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            self.stop()
            raise
        frontend_ip = ray.util.get_node_ip_address()
        self.engines = [RayEngine(ray, a, config, i, w, frontend_ip) for i, (a, w) in enumerate(zip(actors, wheres))]
        logger.info("Ray: data-parallel engines on nodes %s (frontend on %s).",
                    [e.node_id for e in self.engines], ray.get_runtime_context().get_node_id())

    def stop(self) -> None:
        """Kill every actor and remove the placement group."""
        for engine in self.engines:
            engine.stop()
        if self._placement is not None and self._ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._placement)
            except Exception:
                pass
        self._placement = None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
