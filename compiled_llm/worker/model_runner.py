"""The model runner: loads the model, owns the KV cache, and turns a scheduler step into one
forward pass over a flat batch of tokens and the tokens sampled from it.

Per step: apply the scheduler's changes to the persistent request rows (`InputBatch`), gather
the flat batch into persistent buffers (`StepInputs`), run the model inside a forward context,
compute logits only for the requests that sample, and sample with the rows' settings
(`SamplingState`). After the forward and outside it: prompt logprobs from the same hidden states
(`prompt_logprobs`), and for a step with structured outputs the grammar bitmask on the logits
(`grammar_bitmask`). With speculative decoding: the drafts' verification (`_verify`), and under
asynchronous scheduling the drafts themselves (`_fill_draft_slots`): the scheduler planned the step
before it knew the last one's accepted tokens. Its other jobs live beside it: KV sizing
(`kv_cache_sizing`), compilation and CUDA-graph capture (`compile_and_capture`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from compiled_llm.compilation.compile_cache import drop_read_ahead
from compiled_llm.compilation.config import CUDAGraphMode
from compiled_llm.compilation.counters import counters
from compiled_llm.compilation.cudagraph_dispatcher import CudagraphDispatcher
from compiled_llm.compilation.forward_context import set_forward_context
from compiled_llm.config import EngineConfig, describe_cpu_dtype
from compiled_llm.distributed.communication import broadcast_from_driver
from compiled_llm.distributed.parallel_state import tensor_parallel
from compiled_llm.kernels.cpu_extension import uses_cpu_kernels
from compiled_llm.logger import init_logger
from compiled_llm.lora.manager import LoRAManager
from compiled_llm.messages.runner_output import LogprobsLists, ModelRunnerOutput
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.models.layers.attention import Attention
from compiled_llm.models.layers.lora import install_lora, lora_stack_dtype
from compiled_llm.models.loader import build_model
from compiled_llm.utils import cdiv
from compiled_llm.worker import kv_cache_sizing
from compiled_llm.worker.cache_factors import engine_compile_cache, start_reading_packed_weights
from compiled_llm.worker.compile_and_capture import capture_cudagraphs, compile_model, compile_summary
from compiled_llm.worker.draft_proposer import DraftModelProposer
from compiled_llm.worker.grammar_bitmask import apply_grammar_bitmask
from compiled_llm.worker.input_batch import InputBatch
from compiled_llm.worker.ngram_proposer import NgramProposer
from compiled_llm.worker.pooler import Pooler, PoolSegment
from compiled_llm.worker.prompt_logprobs import PromptLogprobsComputer, PromptLogprobsTensors, PromptSegment
from compiled_llm.worker.rejection_sampler import RejectionOutput, RejectionSampler
from compiled_llm.worker.sampler import Sampler, SamplerOutput
from compiled_llm.worker.step_inputs import StepInputs
from compiled_llm.worker.step_output import ReadyStepOutput, StepOutput

logger = init_logger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device
        mc, sc = config.model_config, config.scheduler_config
        self.block_size = config.cache_config.block_size
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        max_blocks_per_req = cdiv(mc.max_model_len, self.block_size)
        cc = config.compilation_config
        start_reading_packed_weights(config)  # beside the cache key and the model's construction
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":  # the C++ kernels share their work over these threads, unpinned
            logger.info("CPU: %d threads (COMPILED_LLM_NUM_THREADS / --num-threads; default: the cores this process "
                        "may use), not pinned; dtype %s.", torch.get_num_threads(), describe_cpu_dtype(mc.dtype))
        torch.manual_seed(mc.seed)

        started = time.perf_counter()
        # Builds the C++ CPU kernels once per machine, now rather than mid-step.
        cpu_kernels = uses_cpu_kernels(self.device, mc.dtype)
        packed_cache = engine_compile_cache(config, tensor_parallel().rank) if cc.level else None
        self.model = build_model(mc, self.device, cpu_kernels=cpu_kernels, packed_cache=packed_cache,
                                 require_cache_hit=cc.require_cache_hit)
        drop_read_ahead()  # a wrong guess's bytes
        self.load_seconds = time.perf_counter() - started
        self.tensor_parallel = tensor_parallel()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_kv_heads = self.attention_layers[0].num_kv_heads  # this rank's (tensor parallelism)
        self.model_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.model.forward
        self.compiled_forward = None  # set by `compile`

        # With asynchronous scheduling a request that its tokens in flight will end leaves the
        # scheduler's batch (making room for another) a step before the runner may drop its row.
        rows = self.max_num_reqs * (2 if sc.async_scheduling else 1)
        self.batch = InputBatch(
            rows, mc.max_model_len, max_blocks_per_req, self.device, mc.vocab_size, mc.eos_token_ids
        )
        self.inputs = StepInputs(self.max_num_tokens, self.max_num_reqs, max_blocks_per_req, self.block_size,
                                 self.device)
        self.lora: LoRAManager | None = None  # LoRA on: the adapters in the model's slots
        if config.lora_config is not None:
            lc = config.lora_config
            layers, scalings = install_lora(self.model, lc.max_loras, lc.max_lora_rank, self.inputs.lora_indices.gpu,
                                            mc.dtype, lora_stack_dtype(lc.lora_dtype, mc.dtype, cpu_kernels),
                                            cpu_kernels)
            self.lora = LoRAManager(layers, scalings, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras, mc.hf_config)
            self.lora_rows = np.zeros(rows, dtype=np.int64)  # each row's adapter id (0: the base model)
        self.sampler = Sampler()
        self.speculative_config = spec = config.speculative_config
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.drafter: DraftModelProposer | None = None
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModelProposer(config, rows, max_blocks_per_req)
        self.async_scheduling = sc.async_scheduling
        self.ngram: NgramProposer | None = None  # asynchronous scheduling: n-gram drafts come from here
        if spec is not None and spec.method == "ngram" and sc.async_scheduling:
            assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
            self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        # (asynchronous speculation) Drafts each request's verification in step `_rejected_step`
        # rejected: the scheduler planned the next step as if they were accepted.
        self._rejected: dict[str, int] = {}
        self._rejected_step = -1
        self.prompt_logprobs = PromptLogprobsComputer(lambda hidden: self.model.compute_logits(hidden))
        # The pooling runner: pooled final hidden states instead of logits, for every request.
        self.pooler = Pooler(mc.pooler_config) if mc.runner == "pooling" and mc.pooler_config else None
        self.num_grammar_bitmasks = 0  # steps whose logits a grammar bitmask constrained
        self.kv_caches: list[torch.Tensor] = []
        self.dispatcher: CudagraphDispatcher | None = None  # set when CUDA graphs are captured
        self._step = 0  # steps executed
        self._last_sampled = torch.zeros(0, dtype=torch.int64, device=self.device)  # the last step's samples

    # ---- KV cache -------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return kv_cache_sizing.kv_bytes_per_block(self.config.model_config, self.block_size, self.num_kv_heads)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        budget = cache.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.profile_run()
            torch.cuda.synchronize()
            budget = kv_cache_sizing.gpu_kv_budget(
                cache, torch.cuda.max_memory_allocated(), self.max_num_tokens, self.captures_cudagraphs
            )
            budget = max(budget, self.kv_bytes_per_block() * 2)
        elif budget is None:
            budget = kv_cache_sizing.cpu_kv_budget(
                self.config.model_config, self.block_size, self.max_num_reqs, self.num_kv_heads
            )
        # A draft model's cache has the same blocks: the budget holds both.
        draft_bytes = self.drafter.kv_bytes_per_block() if self.drafter is not None else 0
        return kv_cache_sizing.num_blocks_for(budget, self.config.model_config, self.block_size, self.num_kv_heads,
                                              draft_bytes)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the largest step the scheduler can make (max_num_batched_tokens tokens, full-length
        requests, then logits and a softmax for max_num_seqs rows) against a one-block stand-in KV
        cache that nothing writes to (every slot is -1): its peak is what serving adds to weights."""
        mc = self.config.model_config
        num_tokens = min(self.max_num_tokens, self.max_num_reqs * mc.max_model_len)
        query_lens = [mc.max_model_len] * (num_tokens // mc.max_model_len)
        if num_tokens % mc.max_model_len:
            query_lens.append(num_tokens % mc.max_model_len)
        scratch = torch.zeros((2, 1, self.block_size, self.num_kv_heads, mc.head_dim), dtype=mc.dtype,
                              device=self.device)
        kept = [layer.kv_cache for layer in self.attention_layers]
        for layer in self.attention_layers:
            layer.kv_cache = scratch
        try:
            with set_forward_context(self.inputs.dummy(num_tokens, query_lens=query_lens)):
                hidden = self.model_forward(*self.inputs.model_args(num_tokens))
            # A verification step computes logits at every draft position too.
            spec = self.speculative_config
            logits_rows = self.max_num_reqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
            logits = self.model.compute_logits(hidden[: min(logits_rows, num_tokens)])
            torch.softmax(logits.float(), dim=-1)  # the sampler's float32 working copy
        finally:
            for layer, cache in zip(self.attention_layers, kept):
                layer.kv_cache = cache

    def pin_lora(self, adapter_id: int, path: str) -> str | None:
        """Read an accepted request's adapter into host memory, kept there until `unpin_lora`;
        returns why it cannot be served (None: it can). See lora/manager.py."""
        assert self.lora is not None
        return self.lora.pin(adapter_id, path)

    def unpin_lora(self, adapter_id: int) -> None:
        assert self.lora is not None
        self.lora.unpin(adapter_id)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.config.model_config
        shape = (mc.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        kv = kv_cache_sizing.allocate_kv_cache(shape, mc.dtype, self.device)
        self.kv_caches = list(kv.unbind(0))
        for layer, cache in zip(self.attention_layers, self.kv_caches):
            layer.kv_cache = cache
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens).",
            num_blocks, self.block_size, kv.numel() * kv.element_size() / (1 << 30), (num_blocks - 1) * self.block_size,
        )

    # ---- one step ---------------------------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        for rid in out.finished_req_ids:
            batch.remove(rid)
            self.prompt_logprobs.forget(rid)
            if self.ngram is not None:
                self.ngram.forget(rid)
        for rid in out.preempted_req_ids:
            batch.remove(rid, keep_sampling_state=True)
            self.prompt_logprobs.forget(rid)
        if self.pooler is not None:
            for rid in (*out.finished_req_ids, *out.preempted_req_ids):
                self.pooler.forget(rid)
            for new_req in out.scheduled_new_reqs:
                self.pooler.add(new_req.req_id, new_req.pooling_params)
        rejected = self._rejected if self._rejected_step == self._step else {}  # by the step just before
        self._rejected = {}
        for cached in out.scheduled_cached_reqs:
            row = batch.row_of[cached.req_id]
            if cached.new_block_ids:
                batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens - rejected.get(cached.req_id, 0)
            assert cached.req_id not in rejected or batch.num_computed_tokens[row] == batch.num_tokens[row] - 1, (
                f"request {cached.req_id}: the scheduler's count and the runner's part")
        for new in out.scheduled_new_reqs:
            row = batch.add(new)
            if self.lora is not None:
                self.lora_rows[row] = self.lora.add_adapter(new.lora_request)
            if self.drafter is not None:
                self.drafter.reset_row(row)
        if self.speculative_config is not None:
            batch.num_drafts.fill(0)
            for rid, drafts in out.scheduled_spec_decode_tokens.items():
                batch.set_drafts(batch.row_of[rid], drafts)

    @torch.inference_mode()
    def execute_model(
        self, out: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> ModelRunnerOutput:
        return self.execute_model_async(out, grammar_bitmask).get_output()

    @torch.inference_mode()
    def execute_model_async(
        self, out: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> StepOutput:
        """Run one step and return at once: on a GPU the forward and the sampling are queued on the
        device, and the sampled ids stay there (the next step reads them from there); the host
        gets them from `StepOutput.get_output`, which waits for the copy.

        `grammar_bitmask` (steps that sample a request with structured outputs): called once the
        forward is launched, it returns one bitmask row per `out.structured_output_request_ids`."""
        self.update_states(out)
        self._step += 1
        if out.empty:
            return StepOutput(self.batch, self.device, self._step, [])
        batch = self.batch
        num_scheduled, proposed = out.num_scheduled_tokens, {}
        if self.async_scheduling and out.scheduled_spec_decode_tokens:
            num_scheduled, proposed = self._fill_draft_slots(out)
        # Decodes (one query token) first: attention handles them in one batched call.
        req_ids = sorted(num_scheduled, key=lambda r: num_scheduled[r] != 1)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter((num_scheduled[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        total = int(num_sched.sum())
        num_decodes = int(np.count_nonzero(num_sched == 1))  # sorted first
        mode, descriptor = CUDAGraphMode.NONE, None
        if self.dispatcher is not None:
            mode, descriptor = self.dispatcher.dispatch_batch(num_sched)
        padded_tokens = descriptor.num_tokens if descriptor is not None else total
        padded_reqs = descriptor.num_reqs if descriptor is not None and descriptor.num_reqs else len(req_ids)
        if self.drafter is not None:  # its drafts replace the scheduler's placeholders
            self.drafter.propose(batch, rows, num_sched)
        lora_slots = self.lora.slots_for(self.lora_rows[rows]) if self.lora is not None else None
        metadata, seq_lens = self.inputs.prepare(batch, rows, num_sched, num_decodes, padded_tokens, padded_reqs,
                                                 lora_slots=lora_slots)
        self._feed_pending_tokens(rows, metadata.query_start_loc_cpu)
        with set_forward_context(metadata, mode, descriptor):
            hidden = self.model_forward(*self.inputs.model_args(padded_tokens))
        if self.pooler is not None:
            return self._pool(req_ids, rows, num_sched, hidden, metadata.query_start_loc_cpu)
        prompt_logprobs: dict[str, PromptLogprobsTensors] = {}
        if (batch.num_prompt_logprobs[rows] >= 0).any():
            segments = self._prompt_segments(req_ids, rows, num_sched, metadata.query_start_loc_cpu)
            prompt_logprobs = self.prompt_logprobs.compute(hidden, segments)

        # Only requests whose every known token (and draft) is now computed sample a token.
        sample_idx = np.flatnonzero(seq_lens == batch.num_tokens[rows] + batch.num_drafts[rows])
        if not len(sample_idx):
            return StepOutput(self.batch, self.device, self._step, req_ids, prompt_logprobs=prompt_logprobs)
        if out.scheduled_spec_decode_tokens:
            return self._verify(out, req_ids, rows, sample_idx, hidden, metadata.query_start_loc_cpu,
                                grammar_bitmask, prompt_logprobs, proposed)
        logits_indices = torch.from_numpy(metadata.query_start_loc_cpu[1:][sample_idx] - 1).to(self.device)
        logits = self.model.compute_logits(hidden[logits_indices])
        if grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, grammar_bitmask(), out.structured_output_request_ids,
                                        [req_ids[i] for i in sample_idx])
        sample_rows = rows[sample_idx]
        if self.tensor_parallel.is_driver:
            result = self.sampler(logits, batch.sampling.metadata(sample_rows, batch.num_output_tokens(sample_rows)))
        else:  # the driver samples, once for every rank; this rank takes in its ids
            result = SamplerOutput(torch.empty(len(sample_idx), dtype=torch.int64, device=self.device))
        broadcast_from_driver(result.sampled)
        batch.sampling.record_sampled(sample_rows, result.sampled)
        positions = batch.add_sampled(sample_rows, self._step)
        self._last_sampled = result.sampled
        return StepOutput(self.batch, self.device, self._step, req_ids, sample_idx, sample_rows, positions, result,
                          prompt_logprobs)

    def _pool(self, req_ids: list[str], rows: np.ndarray, num_sched: np.ndarray, hidden: torch.Tensor,
              query_start_loc: np.ndarray) -> ReadyStepOutput:
        """A pooling step: each request's rows go to the pooler; those whose prompt this step
        completes get their vector (read on the host at once: the request ends with it)."""
        start = self.batch.num_computed_tokens[rows]
        done = start + num_sched >= self.batch.num_prompt_tokens[rows]
        assert self.pooler is not None
        segments = [PoolSegment(rid, int(query_start_loc[i]), int(num_sched[i]), int(start[i]), bool(done[i]))
                    for i, rid in enumerate(req_ids)]
        pooled = self.pooler.pool(hidden, segments)
        return ReadyStepOutput(ModelRunnerOutput(req_ids, [[] for _ in req_ids], pooler_output=pooled))

    def _verify(
        self,
        out: SchedulerOutput,
        req_ids: list[str],
        rows: np.ndarray,
        sample_idx: np.ndarray,
        hidden: torch.Tensor,
        query_start_loc: np.ndarray,
        grammar_bitmask: Callable[[], torch.Tensor] | None,
        prompt_logprobs: dict[str, PromptLogprobsTensors],
        proposed: dict[str, int],
    ) -> ReadyStepOutput:
        """Sample a step with draft tokens: logits at each sampling request's last 1 + n positions
        (n its drafts, often 0), the rejection sampler's verdict, and 1..n+1 tokens each, read on
        the host at once (the next step's drafts follow them). `proposed`: requests whose draft
        slots `_fill_draft_slots` filled in part, and with how many drafts."""
        batch = self.batch
        sample_rows = rows[sample_idx]
        num_drafts = batch.num_drafts[sample_rows].copy()
        counts = num_drafts + 1
        starts = np.cumsum(counts) - counts
        within = np.arange(int(counts.sum())) - np.repeat(starts, counts)
        ends = query_start_loc[1:][sample_idx]
        logits_indices = np.repeat(ends - counts, counts) + within
        logits = self.model.compute_logits(hidden[torch.from_numpy(logits_indices).to(self.device)])
        sampling_ids = [req_ids[i] for i in sample_idx]
        if grammar_bitmask is not None:  # a constrained request's bitmask rows: one per verified position
            first_row = {rid: int(starts[i]) for i, rid in enumerate(sampling_ids)}
            count = dict(zip(sampling_ids, counts.tolist()))
            rows_of = [first_row[rid] + j for rid in out.structured_output_request_ids for j in range(count[rid])]
            apply_grammar_bitmask(logits, grammar_bitmask(), rows_of)
            self.num_grammar_bitmasks += 1
        draft_req = np.repeat(np.arange(len(sample_rows)), num_drafts)
        draft_at = batch.num_tokens[sample_rows][draft_req] + within[within < np.repeat(num_drafts, counts)]
        draft_ids = torch.from_numpy(batch.token_ids[sample_rows[draft_req], draft_at]).to(self.device)
        if self.tensor_parallel.is_driver:
            position_rows = np.repeat(sample_rows, counts)
            meta = batch.sampling.metadata(position_rows, np.repeat(batch.num_output_tokens(sample_rows), counts)
                                           + within)
            sampling = batch.sampling
            generators = {} if meta.all_greedy else {
                i: sampling.generators[int(row)] for i, row in enumerate(sample_rows) if sampling.has_generator[row]}
            result = self.rejection_sampler(logits, meta, num_drafts, draft_ids, generators)
        else:  # the driver samples, once for every rank; this rank takes in its tokens
            width = int(num_drafts.max()) + 1
            result = RejectionOutput(torch.empty((len(sample_rows), width), dtype=torch.int64, device=self.device))
        broadcast_from_driver(result.tokens)
        # Requests with penalties are never given drafts: their one token is the first column.
        batch.sampling.record_sampled(sample_rows, result.tokens[:, 0].contiguous())
        tokens = result.tokens.cpu().numpy()
        num_out = batch.append_verified(sample_rows, tokens)
        if self.drafter is not None:
            self.drafter.verified(sample_rows, num_drafts, num_out)
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        for j, (i, n) in enumerate(zip(sample_idx.tolist(), num_out.tolist())):
            sampled_lists[i] = tokens[j, :n].tolist()
        if self.async_scheduling:  # the next step, planned already, counted every draft slot as accepted
            slots = out.scheduled_spec_decode_tokens
            self._rejected = {rid: len(slots[rid]) - (len(sampled_lists[i]) - 1)
                              for i, rid in enumerate(req_ids) if rid in slots and sampled_lists[i]}
            self._rejected_step = self._step
        logprobs = self._verified_logprobs(result, sampling_ids, sample_rows, starts, num_out)
        return ReadyStepOutput(ModelRunnerOutput(
            req_ids, sampled_lists, logprobs, {rid: t.to_lists() for rid, t in prompt_logprobs.items()},
            num_proposed_drafts=proposed))

    def _verified_logprobs(
        self, result: RejectionOutput, sampling_ids: list[str], sample_rows: np.ndarray, starts: np.ndarray,
        num_out: np.ndarray,
    ) -> dict[str, LogprobsLists]:
        """The logprobs of each request's output tokens (one row per token), for those that want them."""
        if result.logprobs is None:
            return {}
        assert result.logprob_token_ids is not None and result.sampled_ranks is not None
        token_ids, lps, ranks = (t.cpu().tolist() for t in (result.logprob_token_ids, result.logprobs,
                                                            result.sampled_ranks))
        out = {}
        wanted = self.batch.sampling.num_logprobs[sample_rows].tolist()
        for i, (rid, k) in enumerate(zip(sampling_ids, wanted)):
            if k >= 0:
                span = range(int(starts[i]), int(starts[i] + num_out[i]))
                out[rid] = LogprobsLists([token_ids[p][: k + 1] for p in span], [lps[p][: k + 1] for p in span],
                                         [ranks[p] for p in span])
        return out

    def _prompt_segments(
        self, req_ids: list[str], rows: np.ndarray, num_sched: np.ndarray, query_start_loc: np.ndarray
    ) -> list[PromptSegment]:
        """The prompt positions of this step whose next token's logprob a request wants: a chunk
        [start, start + n) predicts the prompt tokens start + 1 .. min(start + n, prompt length) - 1."""
        batch = self.batch
        segments = []
        for i in np.flatnonzero(batch.num_prompt_logprobs[rows] >= 0).tolist():
            row = int(rows[i])
            start, num_prompt = int(batch.num_computed_tokens[row]), int(batch.num_prompt_tokens[row])
            end = max(start, min(start + int(num_sched[i]), num_prompt - 1))
            done = start + int(num_sched[i]) >= num_prompt
            targets = batch.token_ids[row, start + 1 : end + 1].copy()
            segments.append(PromptSegment(req_ids[i], int(query_start_loc[i]), targets,
                                          int(batch.num_prompt_logprobs[row]), done))
            if done:
                batch.num_prompt_logprobs[row] = -1
        return segments

    def _apply_grammar_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, constrained: list[str], sampling_ids: list[str]
    ) -> None:
        """Bitmask row i constrains the logits row of request `constrained[i]`."""
        where = {rid: i for i, rid in enumerate(sampling_ids)}
        missing = [rid for rid in constrained if rid not in where]
        assert not missing, f"constrained requests {missing} do not sample in this step"
        apply_grammar_bitmask(logits, bitmask, [where[rid] for rid in constrained])
        self.num_grammar_bitmasks += 1

    def _fill_draft_slots(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, int]]:
        """(Speculation with asynchronous scheduling) The scheduler gave draft slots without knowing
        the tokens the last step sampled; the rows hold them now: a token the device sampled in the
        last step comes to the host here, and n-gram lookups fill the slots (the draft model fills
        them later, in `execute_model_async`). Where a lookup finds fewer drafts than slots, the
        request computes fewer tokens: returns each request's token count in this step, and the
        requests with unfilled slots and their number of drafts."""
        batch = self.batch
        req_ids = list(out.num_scheduled_tokens)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        pending = rows[batch.pending_step[rows] >= 0]
        if len(pending):
            assert (batch.pending_step[pending] == self._step - 1).all(), "a pending token from an older step"
            sampled = self._last_sampled[torch.from_numpy(batch.pending_index[pending]).to(self.device)]
            batch.token_ids[pending, batch.num_tokens[pending] - 1] = sampled.cpu().numpy()
            batch.pending_step[pending] = -1
        if self.ngram is None:
            return out.num_scheduled_tokens, {}
        slots = batch.num_drafts[rows].copy()
        found = self.ngram.propose(batch, req_ids, rows)
        short = np.flatnonzero(found < slots)
        if not len(short):
            return out.num_scheduled_tokens, {}
        num_scheduled = dict(out.num_scheduled_tokens)
        for i in short.tolist():
            num_scheduled[req_ids[i]] -= int(slots[i] - found[i])
        return num_scheduled, {req_ids[i]: int(found[i]) for i in short.tolist()}

    def _feed_pending_tokens(self, rows: np.ndarray, query_start_loc: np.ndarray) -> None:
        """Requests whose last token the previous step sampled and the host has not seen yet
        (asynchronous scheduling) compute it now: copy it into the input ids on the device."""
        batch = self.batch
        pending = np.flatnonzero(batch.pending_step[rows] >= 0)
        if not len(pending):
            return
        pending_rows = rows[pending]
        assert (batch.pending_step[pending_rows] == self._step - 1).all(), "a pending token from an older step"
        position = batch.num_tokens[pending_rows] - 1
        flat = query_start_loc[pending] + position - batch.num_computed_tokens[pending_rows]
        self.inputs.input_ids.gpu[torch.from_numpy(flat).to(self.device)] = self._last_sampled[
            torch.from_numpy(batch.pending_index[pending_rows]).to(self.device)
        ]

    # ---- start-up ----------------------------------------------------------------------------
    def compile_or_warm_up(self) -> float:
        """At -O1 and above: compile (or load) every piece now; at -O2 on a GPU also capture the
        CUDA graphs. Nothing is compiled or captured later, while serving. Returns the seconds the
        captures took (0 where none)."""
        if self.config.compilation_config.level:
            self.compile()
        captured_for = counters.cudagraph_capture_seconds
        if self.captures_cudagraphs:
            spec = self.speculative_config  # full-length verifications get FULL graphs too
            query_lens = (1,) if spec is None else (1, 1 + spec.num_speculative_tokens)
            self.model_forward, self.dispatcher = capture_cudagraphs(
                self.model_forward, self.inputs, self.config.compilation_config, self.max_num_tokens,
                self.max_num_reqs, query_lens,
            )
            if self.drafter is not None:
                self.drafter.capture_cudagraphs()
        return counters.cudagraph_capture_seconds - captured_for

    @property
    def captures_cudagraphs(self) -> bool:
        """-O2 on a GPU with a CUDA-graph mode: graphs are captured at start-up."""
        config = self.config.compilation_config
        return self.device.type == "cuda" and config.level >= 2 and config.cudagraph_mode is not CUDAGraphMode.NONE

    def compile(self) -> dict[str, Any]:
        """Compile (or load) every piece, capturing no CUDA graph (all `precompile` does); returns
        what this rank did (`compile_summary`)."""
        rank = self.tensor_parallel.rank
        self.compiled_forward = compile_model(
            self.model, self.inputs, self.config.compilation_config, engine_compile_cache(self.config, rank),
            self.max_num_tokens,
        )
        self.model_forward = self.compiled_forward
        summary = compile_summary(self.compiled_forward, rank)
        if self.drafter is not None:  # its own entry; precompile counts its work with the target's
            draft = self.drafter.compile()
            for name in ("inductor_compilations", "artifacts_saved", "artifacts_loaded", "seconds"):
                summary[name] = (summary[name] or 0) + (draft[name] or 0)
            summary["draft_cache_dir"] = draft["cache_dir"]
        return summary
