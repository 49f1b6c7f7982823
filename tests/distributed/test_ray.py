"""The Ray executor: tensor-parallel ranks as Ray actors in a placement group, on a local Ray
instance and on a two-node cluster simulated on this machine (`ray.cluster_utils.Cluster`), where
the rank must land on the other node; the tokens are those of one rank without Ray."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams

ray = pytest.importorskip("ray")

PROMPTS = ["The capital of France is", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20, num_threads=1)


def generate(model: str, **parallel) -> tuple[list[list[int]], list[str]]:
    llm = LLM(model, **ENGINE, **parallel)
    core = llm.llm_engine.engine_core
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return tokens, list(getattr(core.executor, "worker_nodes", []))
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return generate(tiny_llama)[0]


def test_tp2_on_a_local_ray_instance(tiny_llama, expected):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        tokens, nodes = generate(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    assert tokens == expected and len(nodes) == 1


def test_tp2_across_two_simulated_nodes(tiny_llama, expected):
    from ray.cluster_utils import Cluster

    # The head node has no CPU for actors: Ray must place rank 1 on the second node.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    worker_node = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        tokens, nodes = generate(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert tokens == expected
    assert nodes == [worker_node.node_id]
