"""Data-parallel engines as Ray actors (`data_parallel_size=2, distributed_executor_backend="ray"`):
on a local Ray instance and on a two-node cluster simulated on this machine, both engines answer
concurrent greedy requests with the tokens of one engine without Ray; killing one engine's actor is
the group's death (`EngineDeadError`), not a hang; shutdown removes the placement group."""

from __future__ import annotations

import asyncio

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.async_llm import AsyncLLM
from compiled_llm.engine.core_client import EngineDeadError

ray = pytest.importorskip("ray")

PROMPTS = ["The capital of France is", "Once upon a time", "The capital of France is", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20, num_threads=1)
TIMEOUT = 120


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[list[int]]:
    llm = LLM(tiny_llama, **ENGINE)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()


def start(model: str) -> tuple[AsyncLLM, set[int]]:
    """The group, and the engine indices seen on its outputs (filled as outputs arrive)."""
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=model, data_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    )
    seen: set[int] = set()
    get_output = llm.client.get_output_async

    async def recording() -> object:
        outputs = await get_output()
        if outputs.outputs:
            seen.add(outputs.engine_index)
        return outputs

    llm.client.get_output_async = recording
    return llm, seen


async def generate(llm: AsyncLLM) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        async for out in llm.generate(PROMPTS[i], GREEDY, f"r{i}"):
            last = out
        return last.outputs[0].token_ids

    return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))


def removed_placement_groups() -> bool:
    return all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_dp2_on_a_local_ray_instance_and_an_engine_actors_death(tiny_llama, expected):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        async def main() -> None:
            llm, seen = start(tiny_llama)
            try:
                assert await asyncio.wait_for(generate(llm), TIMEOUT) == expected
                assert seen == {0, 1}
                ray.kill(llm.client.engines[1].engine.actor)
                error = await asyncio.wait_for(llm.wait_until_dead(), 30)
                assert "actor 1 died" in str(error)
                assert llm.errored
                with pytest.raises(EngineDeadError):
                    await llm.add_request("late", "x", GREEDY)
            finally:
                llm.shutdown()
            assert removed_placement_groups()

        asyncio.run(main())
    finally:
        ray.shutdown()


def test_dp2_across_two_simulated_nodes(tiny_llama, expected):
    from ray.cluster_utils import Cluster

    # One CPU a node and one CPU an engine: Ray must put the second engine on the second node.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    both = {cluster.head_node.node_id, cluster.add_node(num_cpus=1).node_id}
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()

        async def main() -> list[str]:
            llm, seen = start(tiny_llama)
            try:
                assert await asyncio.wait_for(generate(llm), TIMEOUT) == expected
                assert seen == {0, 1}
                return [e.engine.node_id for e in llm.client.engines]
            finally:
                llm.shutdown()

        nodes = asyncio.run(main())
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert set(nodes) == both


def test_tensor_parallel_inside_ray_engines_is_refused():
    from compiled_llm.config import ParallelConfig

    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported on the ray backend"):
        ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="ray")
