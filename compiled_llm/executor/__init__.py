"""How the engine core reaches its model runners: one in its own process (`UniProcExecutor`), or
one per tensor-parallel rank, the first in its own process and the others in local processes
(`MultiprocExecutor`) or Ray actors (`RayExecutor`)."""

from __future__ import annotations

from compiled_llm.config import EngineConfig
from compiled_llm.executor.base import Executor


def make_executor(config: EngineConfig, exit_on_worker_death: bool = False) -> Executor:
    """`exit_on_worker_death`: in the engine core's own process, a dead rank ends the process (its
    client reports the engine's death); in the caller's process (offline `LLM`) the collective
    that loses its peer raises instead."""
    parallel = config.parallel_config
    if parallel.tensor_parallel_size == 1:
        from compiled_llm.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    if parallel.distributed_executor_backend == "ray":
        from compiled_llm.executor.ray_executor import RayExecutor

        return RayExecutor(config, exit_on_worker_death)
    from compiled_llm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, exit_on_worker_death)
