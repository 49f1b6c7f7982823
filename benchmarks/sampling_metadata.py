"""Host time per step spent building the sampler's inputs (sampling metadata), at batch 32.

32 running requests on the bundled model, each with a 256-token prompt and 128 generated tokens,
with the knobs a busy server sees mixed across the batch: temperature and top-k/top-p, seeds,
presence/frequency/repetition penalties, logprobs and min_tokens. The figure is the median time
of building one step's sampling metadata, taken after the requests have run (so their state is
what a real step sees), over many repetitions.

    python benchmarks/sampling_metadata.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def build_batch(llm, batch: int, prompt_len: int, output_len: int) -> None:
    from compiled_llm import SamplingParams

    rng = np.random.default_rng(0)
    engine = llm.llm_engine
    for i in range(batch):
        knobs = dict(temperature=0.8, top_k=50, top_p=0.9, seed=i) if i % 2 else dict(temperature=0.0)
        if i % 4 == 1:
            knobs.update(presence_penalty=0.5, frequency_penalty=0.3)
        if i % 4 == 3:
            knobs.update(repetition_penalty=1.1)
        if i % 8 == 0:
            knobs.update(logprobs=5)
        params = SamplingParams(max_tokens=output_len + 1000, min_tokens=output_len + 500, ignore_eos=True, **knobs)
        ids = rng.integers(100, 40000, prompt_len).tolist()
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    generated = 0
    while generated < output_len:
        engine.step()
        generated += 1


def time_metadata(runner, rows: np.ndarray, repeats: int) -> float:
    build = getattr(runner, "sampling_metadata", None)
    if build is None:  # after the runner's split: the input batch keeps the sampling state
        batch = runner.batch

        def build(rows: np.ndarray):
            return batch.sampling.metadata(rows, batch.num_output_tokens(rows))
    for _ in range(5):
        build(rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build(rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    from compiled_llm import LLM

    torch.set_num_threads(2)
    llm = LLM(optimization_level=0, max_model_len=1024, kv_cache_memory_bytes=1 << 30, max_num_seqs=args.batch)
    build_batch(llm, args.batch, 256, 128)
    runner = llm.llm_engine.engine_core.executor.driver
    rows = np.array(sorted(runner.batch.row_of.values()), dtype=np.int64)
    assert len(rows) == args.batch
    seconds = time_metadata(runner, rows, args.repeats)
    print(f"sampling metadata, batch {args.batch}: {seconds * 1e3:.3f} ms per step (median of {args.repeats})")


if __name__ == "__main__":
    main()
