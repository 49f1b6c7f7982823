"""Draft-model proposals: a smaller model with the target's vocabulary guesses each speculating
request's next tokens, and the target verifies them in one forward like n-gram drafts.

The draft keeps its own paged KV cache, indexed by the target's block ids (the same block tables
and slots, other tensors), so the scheduler allocates nothing for it: it schedules placeholder
drafts (`Scheduler._propose`), with KV slots for them, and the runner fills them in here before
the target's forward:

1. Catch-up: one draft forward over every scheduled request's known tokens of this step (a prompt
   chunk, or a decode's last sampled token), plus the one token the draft never ran when its last
   verification accepted every draft (the last draft). The logits at a speculating request's last
   known token give its first draft.
2. Then one draft decode step per further draft, for the requests still drafting: each writes the
   previous draft's KV and gives the next draft, into the slots the target then writes again.

A draft's KV is right up to the last accepted token; the rest is written over when those positions
are computed again (as the target's rejected drafts are). Proposals are greedy: a deterministic
proposal keeps the rejection sampler's rule (accept with the target's p(d), else resample without
d) exact for sampling too. Nothing the draft computes can change an output, only how many tokens a
verification accepts.

The draft is compiled like the target, into its own compile-cache entry (`role: draft`), and at
-O2 on a GPU captured in CUDA graphs like it: its one-token steps (every draft after the first) as
FULL graphs of uniform decode batches, the catch-up forwards as PIECEWISE ones. It lives with the
runner (it runs a model), not in spec_decode/, whose proposers are pure functions of a request's
tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np
import torch

from compiled_llm.compilation.config import CUDAGraphMode
from compiled_llm.compilation.cudagraph_dispatcher import CudagraphDispatcher
from compiled_llm.compilation.forward_context import set_forward_context
from compiled_llm.config import EngineConfig
from compiled_llm.kernels.cpu_extension import uses_cpu_kernels
from compiled_llm.logger import init_logger
from compiled_llm.models.layers.attention import Attention
from compiled_llm.models.loader import build_model
from compiled_llm.worker import kv_cache_sizing
from compiled_llm.worker.cache_factors import engine_compile_cache
from compiled_llm.worker.compile_and_capture import capture_cudagraphs, compile_model, compile_summary
from compiled_llm.worker.input_batch import InputBatch
from compiled_llm.worker.sampler import argmax_rows
from compiled_llm.worker.step_inputs import StepInputs

logger = init_logger(__name__)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, num_rows: int, max_blocks_per_req: int) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        mc = spec.draft_model_config
        self.config = dataclasses.replace(config, model_config=mc)  # what its compile-cache entry hashes
        self.device = config.torch_device
        self.block_size = config.cache_config.block_size
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        started = time.perf_counter()
        self.model = build_model(mc, self.device, cpu_kernels=uses_cpu_kernels(self.device, mc.dtype))
        self.load_seconds = time.perf_counter() - started
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_kv_heads = self.attention_layers[0].num_kv_heads
        self.inputs = StepInputs(self.max_num_tokens, self.max_num_reqs, max_blocks_per_req, self.block_size,
                                 self.device)
        self.forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.model.forward
        self.dispatcher: CudagraphDispatcher | None = None  # set when CUDA graphs are captured
        # Per batch row: the known tokens before num_computed_tokens that the draft has not run (0 or 1).
        self.lag = np.zeros(num_rows, dtype=np.int64)
        logger.info("Draft model %s: %d layers, loaded in %.2f s.", mc.model, mc.num_layers, self.load_seconds)

    # ---- KV cache and compilation --------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return kv_cache_sizing.kv_bytes_per_block(self.config.model_config, self.block_size, self.num_kv_heads)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.config.model_config
        shape = (mc.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        kv = kv_cache_sizing.allocate_kv_cache(shape, mc.dtype, self.device)
        for layer, cache in zip(self.attention_layers, kv.unbind(0)):
            layer.kv_cache = cache
        logger.info("Draft KV cache: %d blocks (%.2f GiB).", num_blocks, kv.numel() * kv.element_size() / (1 << 30))

    def compile(self) -> dict[str, Any]:
        compiled = compile_model(self.model, self.inputs, self.config.compilation_config,
                                 engine_compile_cache(self.config, 0, role="draft"), self.max_num_tokens)
        self.forward = compiled
        return compile_summary(compiled, 0)

    def capture_cudagraphs(self) -> None:
        """-O2 on a GPU, after `compile` (the runner decides): capture the draft's graphs."""
        self.forward, self.dispatcher = capture_cudagraphs(
            self.forward, self.inputs, self.config.compilation_config, self.max_num_tokens, self.max_num_reqs,
            name="draft model",
        )

    # ---- one step --------------------------------------------------------------------------------
    def reset_row(self, row: int) -> None:
        """A request (new, or resumed after preemption) took `row`: the draft's KV matches the
        target's up to its computed tokens (prefix-cache hits included: their blocks were written
        by both)."""
        self.lag[row] = 0

    def propose(self, batch: InputBatch, rows: np.ndarray, num_sched: np.ndarray) -> None:
        """Fill in the drafts of this step's requests (`batch.num_drafts` of them each, after their
        known tokens) and run the draft over every known token the step computes."""
        drafts = batch.num_drafts[rows]
        computed = batch.num_computed_tokens[rows]
        lag = self.lag[rows]
        count = num_sched - drafts + lag
        drafting = np.flatnonzero(drafts > 0)
        first = self._run(batch, rows, computed - lag, count, drafting)
        batch.token_ids[rows[drafting], batch.num_tokens[rows[drafting]]] = first
        for j in range(1, int(drafts.max(initial=0))):
            still = rows[drafts > j]
            at = batch.num_tokens[still] + j - 1  # the previous draft's position
            batch.token_ids[still, at + 1] = self._run(batch, still, at, np.ones(len(still), dtype=np.int64),
                                                       np.arange(len(still)))
        self.lag[rows] = 0

    def verified(self, rows: np.ndarray, num_drafts: np.ndarray, num_out: np.ndarray) -> None:
        """After the target's verification: a row that accepted all its drafts got the last one
        (and a bonus token) without the draft ever running it."""
        self.lag[rows] = (num_drafts > 0) & (num_out == num_drafts + 1)

    @torch.inference_mode()
    def _run(self, batch: InputBatch, rows: np.ndarray, start: np.ndarray, count: np.ndarray,
             wanted: np.ndarray) -> np.ndarray:
        """Draft forwards over tokens [start, start + count) of each row (in chunks of at most
        max_num_batched_tokens tokens); the argmax after the last token of each row in `wanted`
        (indices into `rows`)."""
        want = np.zeros(len(rows), dtype=bool)
        want[wanted] = True
        order = np.argsort(count != 1, kind="stable")  # single tokens first, as attention wants them
        order = order[count[order] > 0]
        tokens: dict[int, int] = {}
        chunk: list[int] = []
        total = 0
        for i in [*order.tolist(), -1]:
            if i >= 0 and total + int(count[i]) <= self.max_num_tokens:
                chunk.append(i)
                total += int(count[i])
                continue
            if chunk:
                tokens.update(self._forward_chunk(batch, rows, start, count, want, np.asarray(chunk)))
            chunk, total = ([i], int(count[i])) if i >= 0 else ([], 0)
        return np.asarray([tokens[int(i)] for i in wanted], dtype=np.int64)

    def _forward_chunk(self, batch: InputBatch, rows: np.ndarray, start: np.ndarray, count: np.ndarray,
                       want: np.ndarray, chunk: np.ndarray) -> dict[int, int]:
        n = count[chunk]
        mode, descriptor = CUDAGraphMode.NONE, None
        if self.dispatcher is not None:
            mode, descriptor = self.dispatcher.dispatch_batch(n)
        padded_tokens = descriptor.num_tokens if descriptor is not None else int(n.sum())
        padded_reqs = descriptor.num_reqs if descriptor is not None and descriptor.num_reqs else len(chunk)
        metadata, _ = self.inputs.prepare(batch, rows[chunk], n, int(np.count_nonzero(n == 1)), padded_tokens,
                                          padded_reqs, computed=start[chunk])
        with set_forward_context(metadata, mode, descriptor):
            hidden = self.forward(*self.inputs.model_args(padded_tokens))
        picked = np.flatnonzero(want[chunk])
        if not len(picked):
            return {}
        ends = metadata.query_start_loc_cpu[1:][picked] - 1
        logits = self.model.compute_logits(hidden[torch.from_numpy(ends).to(self.device)])
        return dict(zip(chunk[picked].tolist(), argmax_rows(logits).tolist()))
