"""Tensor parallelism over Ray: ranks 1..N-1 are Ray actors placed by Ray in a placement group
(one bundle per rank: CPUs for its threads, or a GPU), so the ranks of one engine may sit on
different nodes of a Ray cluster; rank 0, the driver, stays in the engine core's process.

Every node must see the model folder and the compile cache at the same paths (shared storage,
or the same files): each rank reads its slice of the weights and loads or fills its own cache
entry there. Ranks reach each other with torch.distributed over TCP at the driver node's address.
`RAY_ADDRESS` picks the cluster (else a local Ray instance is started).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import msgspec
import torch

from compiled_llm.config import EngineConfig
from compiled_llm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from compiled_llm.executor.base import MultiRankExecutor
from compiled_llm.logger import init_logger
from compiled_llm.messages.runner_output import AsyncModelRunnerOutput
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.utils import get_open_port, import_ray

logger = init_logger(__name__)


class _RayWorker:
    """A Ray actor holding one rank (the class is wrapped by `ray.remote` at run time)."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str) -> None:
        from compiled_llm.worker.worker import Worker

        self.worker = Worker(config, rank, init_method)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        return self.worker.call(method, args)

    def execute(self, payload: bytes) -> None:
        self.worker.execute(payload)

    def shutdown(self) -> None:
        self.worker.shutdown()


class RayExecutor(MultiRankExecutor):
    def __init__(self, config: EngineConfig, exit_on_worker_death: bool = False) -> None:
        super().__init__(config)
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
        self._ray = ray
        self._exit_on_worker_death = exit_on_worker_death
        world_size = config.parallel_config.tensor_parallel_size
        threads = config.num_threads or 1
        on_gpu = config.torch_device.type == "cuda"
        bundle = {"GPU": 1} if on_gpu else {"CPU": threads}
        driver_node = ray.get_runtime_context().get_node_id()
        # Packed onto as few nodes as hold them; Ray spreads them when one node has no room.
        self._placement = placement_group([bundle] * (world_size - 1), strategy="PACK")
        ray.get(self._placement.ready(), timeout=300)
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{get_open_port()}"
        actor_class = ray.remote(num_cpus=0 if on_gpu else threads, num_gpus=1 if on_gpu else 0)(_RayWorker)
        self.workers = [
            actor_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank - 1
                ),
                runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("COMPILED_LLM_")}},
            ).remote(config, rank, init_method)
            for rank in range(1, world_size)
        ]
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: list[Any] = []
        try:
            init_tensor_parallel(0, world_size, init_method, config.torch_device)
            self._build_driver()
            self.worker_nodes = ray.get([w.node_id.remote() for w in self.workers])
        except BaseException:
            self.shutdown()
            raise
        logger.info("Ray: tensor-parallel ranks on nodes %s (driver on %s).", self.worker_nodes, driver_node)

    # ---- commands ------------------------------------------------------------------------------
    def _send_to_workers(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        return [w.call.remote(method, args) for w in self.workers]

    def _worker_results(self, pending: list[Any]) -> list[Any]:
        return self._ray.get(pending)

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> AsyncModelRunnerOutput:
        self._check_workers()
        payload = self._encoder.encode(scheduler_output)
        self._pending += [w.execute.remote(payload) for w in self.workers]
        return self.driver.execute_model_async(scheduler_output, grammar_bitmask)

    def _check_workers(self) -> None:
        """Surface a rank's failure from the steps it finished (a dead actor raises here)."""
        if not self._pending:
            return
        done, self._pending = self._ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        try:
            self._ray.get(done)
        except Exception as e:
            logger.error("A tensor-parallel Ray worker failed: %s", e)
            if self._exit_on_worker_death:
                os._exit(1)
            raise

    def shutdown(self) -> None:
        ray = self._ray
        for worker in getattr(self, "workers", []):
            try:
                ray.get(worker.shutdown.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(worker)
        if getattr(self, "_placement", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement)
        destroy_tensor_parallel()
