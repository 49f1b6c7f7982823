"""The model runner: loads the model, owns the KV cache, turns a scheduler step into one forward
pass over a flat batch of tokens, and samples.

Per step: apply the scheduler's changes to the persistent request rows, gather the flat batch
(input ids, positions, slot mapping, block tables, sequence lengths, query start offsets) into
persistent buffers with numpy, run the model inside a forward context, compute logits only for
the requests that sample, and sample.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import psutil
import torch

from compiled_llm.compilation.config import CUDAGraphMode
from compiled_llm.compilation.cudagraph_dispatcher import CudagraphDispatcher
from compiled_llm.compilation.forward_context import set_forward_context
from compiled_llm.config import EngineConfig
from compiled_llm.engine.messages import LogprobsLists
from compiled_llm.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from compiled_llm.kernels.metadata import AttentionMetadata
from compiled_llm.logger import init_logger
from compiled_llm.models.layers.attention import Attention
from compiled_llm.models.loader import build_model
from compiled_llm.utils import cdiv
from compiled_llm.worker.buffers import CpuGpuBuffer
from compiled_llm.worker.input_batch import InputBatch
from compiled_llm.worker.sampler import Sampler, SamplingMetadata, SamplerOutput

logger = init_logger(__name__)

_CPU_DEFAULT_KV_BYTES = 2 << 30
_CUDA_GRAPH_RESERVE = 1 << 30  # captured graphs live outside the profiling run


class ModelRunner:
    def __init__(self, config: EngineConfig, load_format: str = "auto") -> None:
        self.config = config
        self.device = config.torch_device
        mc, sc = config.model_config, config.scheduler_config
        self.block_size = config.cache_config.block_size
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_blocks_per_req = cdiv(mc.max_model_len, self.block_size)
        self.eos_token_ids = mc.eos_token_ids
        self.vocab_size = mc.vocab_size
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.use_cpu_kernels = uses_cpu_kernels(config)  # builds them once per machine, now rather than mid-step
        torch.manual_seed(mc.seed)

        start = time.perf_counter()
        self.model = build_model(mc, self.device, load_format)
        self.load_seconds = time.perf_counter() - start
        for module in self.model.modules():
            if hasattr(module, "cpu_kernel"):
                module.cpu_kernel = self.use_cpu_kernels
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.model_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.model.forward

        self.batch = InputBatch(self.max_num_reqs, mc.max_model_len, self.max_blocks_per_req, self.device)
        buf = lambda *shape, dtype=torch.int64, fill=0: CpuGpuBuffer(*shape, dtype=dtype, device=self.device, fill=fill)  # noqa: E731
        self.input_ids = buf(self.max_num_tokens)
        self.positions = buf(self.max_num_tokens)
        self.slot_mapping = buf(self.max_num_tokens, fill=-1)
        self.query_start_loc = buf(self.max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = buf(self.max_num_reqs, dtype=torch.int32)
        self.block_tables = buf(self.max_num_reqs, self.max_blocks_per_req, dtype=torch.int32)
        self._arange = np.arange(max(self.max_num_tokens, self.max_num_reqs) + 1, dtype=np.int64)
        # The host buffers are copied asynchronously; the next step may only overwrite them once
        # those copies ran (a step that samples nothing never waits on the device otherwise).
        self._inputs_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.dispatcher: CudagraphDispatcher | None = None  # set when CUDA graphs are captured

    # ---- KV cache -------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        mc = self.config.model_config
        elem = torch.empty(0, dtype=mc.dtype).element_size()
        return 2 * self.block_size * mc.num_kv_heads * mc.head_dim * elem * mc.num_layers

    def determine_num_blocks(self) -> int:
        cc, mc = self.config.cache_config, self.config.model_config
        per_block = self.kv_bytes_per_block()
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                budget = max(self._gpu_kv_budget(), per_block * 2)
            else:
                # Enough for every sequence at full length if memory allows, within 2 GiB and a
                # fifth of what is free.
                wanted = per_block * (cdiv(mc.max_model_len, self.block_size) * self.max_num_reqs + 1)
                budget = int(min(wanted, _CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 5))
        num_blocks = int(budget // per_block)
        if num_blocks - 1 < self.max_blocks_per_req:
            needed = (self.max_blocks_per_req + 1) * per_block
            raise ValueError(
                f"The KV cache ({budget} bytes, {max(num_blocks - 1, 0) * self.block_size} tokens) cannot hold one "
                f"sequence of max_model_len={mc.max_model_len} tokens; give kv_cache_memory_bytes >= {needed} "
                f"or lower max_model_len."
            )
        return num_blocks

    def _gpu_kv_budget(self) -> int:
        """`gpu_memory_utilization` of the GPU, less what the weights, the largest step's
        activations (measured by a profiling run), other processes and CUDA graphs need."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.profile_run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        outside_torch = total - free - torch.cuda.memory_reserved()  # CUDA context, other processes
        graphs = _CUDA_GRAPH_RESERVE if self.captures_cudagraphs else 0
        budget = int(total * self.config.cache_config.gpu_memory_utilization - peak - outside_torch - graphs)
        logger.info(
            "GPU memory: %.2f GiB total, peak of a %d-token step %.2f GiB (weights included), %.2f GiB outside "
            "torch, %.2f GiB kept for CUDA graphs: %.2f GiB for the KV cache.",
            total / (1 << 30), self.max_num_tokens, peak / (1 << 30), outside_torch / (1 << 30), graphs / (1 << 30),
            budget / (1 << 30),
        )
        return budget

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
        scratch = torch.zeros((2, 1, self.block_size, mc.num_kv_heads, mc.head_dim), dtype=mc.dtype, device=self.device)
        kept = [layer.kv_cache for layer in self.attention_layers]
        for layer in self.attention_layers:
            layer.kv_cache = scratch
        try:
            with set_forward_context(self.dummy_metadata(num_tokens, query_lens=query_lens)):
                hidden = self.model_forward(self.input_ids.gpu[:num_tokens], self.positions.gpu[:num_tokens])
            logits = self.model.compute_logits(hidden[: self.max_num_reqs])
            torch.softmax(logits.float(), dim=-1)  # the sampler's float32 working copy
        finally:
            for layer, cache in zip(self.attention_layers, kept):
                layer.kv_cache = cache

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc = self.config.model_config
        shape = (mc.num_layers, 2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        kv = torch.zeros(shape, dtype=mc.dtype, device=self.device)
        self.kv_caches = list(kv.unbind(0))
        for layer, cache in zip(self.attention_layers, self.kv_caches):
            layer.kv_cache = cache
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens).",
            num_blocks, self.block_size, kv.numel() * kv.element_size() / (1 << 30), (num_blocks - 1) * self.block_size,
        )

    # ---- one step ---------------------------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        for rid in out.finished_req_ids:
            batch.remove(rid)
        for rid in out.preempted_req_ids:
            batch.remove(rid, keep_sampling_state=True)
        for cached in out.scheduled_cached_reqs:
            row = batch.row_of[cached.req_id]
            if cached.new_block_ids:
                batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens
        for new in out.scheduled_new_reqs:
            batch.add(new.req_id, new.token_ids, new.num_prompt_tokens, new.sampling_params, new.block_ids, new.num_computed_tokens)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(out)
        if out.empty:
            return ModelRunnerOutput([], [])
        batch = self.batch
        # Decodes (one query token) first: attention handles them in one batched call.
        req_ids = sorted(out.num_scheduled_tokens, key=lambda r: out.num_scheduled_tokens[r] != 1)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter((out.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        total = int(num_sched.sum())
        num_decodes = int(np.count_nonzero(num_sched == 1))  # sorted first
        mode, descriptor = CUDAGraphMode.NONE, None
        if self.dispatcher is not None:
            mode, descriptor = self.dispatcher.dispatch(total, num_decodes == len(req_ids))
        padded_tokens = descriptor.num_tokens if descriptor is not None else total
        padded_reqs = descriptor.num_reqs if descriptor is not None and descriptor.num_reqs else len(req_ids)
        metadata, seq_lens = self.prepare_inputs(rows, num_sched, num_decodes, padded_tokens, padded_reqs)
        with set_forward_context(metadata, mode, descriptor):
            hidden = self.model_forward(self.input_ids.gpu[:padded_tokens], self.positions.gpu[:padded_tokens])

        # Only requests whose every known token is now computed sample a token.
        num_reqs = len(req_ids)
        samples = seq_lens == batch.num_tokens[rows]
        sample_idx = np.flatnonzero(samples)
        sampled_lists: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: dict[str, LogprobsLists] = {}
        if len(sample_idx):
            logits_indices = torch.from_numpy(metadata.query_start_loc_cpu[1:][sample_idx] - 1).to(self.device)
            logits = self.model.compute_logits(hidden[logits_indices])
            sample_rows = rows[sample_idx]
            result = self.sampler(logits, self.sampling_metadata(sample_rows))
            tokens = result.sampled.tolist()
            for i, token in zip(sample_idx.tolist(), tokens):
                batch.append_token(int(rows[i]), token)
                sampled_lists[i] = [token]
            if result.logprobs is not None:
                logprobs = self._logprobs_lists(result, [req_ids[i] for i in sample_idx], sample_rows)
        return ModelRunnerOutput(req_ids, sampled_lists, logprobs)

    def prepare_inputs(
        self, rows: np.ndarray, num_sched: np.ndarray, num_decodes: int, padded_tokens: int, padded_reqs: int
    ) -> tuple[AttentionMetadata, np.ndarray]:
        """Fill the persistent buffers with the flat batch of `rows` (its `num_decodes` decodes
        first), padded to `padded_tokens` tokens and `padded_reqs` requests for a CUDA graph:
        padded tokens have slot -1 (no KV write), padded requests the null block, length 0 and
        the last offset. Returns the metadata (views of the buffers, sized to the padded batch)
        and the requests' sequence lengths."""
        batch = self.batch
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        num_reqs = len(rows)
        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        computed = batch.num_computed_tokens[rows]
        token_req = np.repeat(np.arange(num_reqs), num_sched)
        token_rows = rows[token_req]
        positions = computed[token_req] + self._arange[:total] - np.repeat(cu - num_sched, num_sched)
        self.positions.np[:total] = positions
        self.input_ids.np[:total] = batch.token_ids[token_rows, positions]
        block_ids = batch.block_table[token_rows, positions // self.block_size]
        self.slot_mapping.np[:total] = block_ids * self.block_size + positions % self.block_size
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu
        seq_lens = computed + num_sched
        self.seq_lens.np[:num_reqs] = seq_lens
        self.block_tables.np[:num_reqs] = batch.block_table[rows]
        if padded_tokens > total:
            self.input_ids.np[total:padded_tokens] = 0
            self.positions.np[total:padded_tokens] = 0
            self.slot_mapping.np[total:padded_tokens] = -1
        if padded_reqs > num_reqs:
            self.query_start_loc.np[num_reqs + 1 : padded_reqs + 1] = total
            self.seq_lens.np[num_reqs:padded_reqs] = 0
            self.block_tables.np[num_reqs:padded_reqs] = 0
        metadata = self._publish(padded_tokens, padded_reqs, total, num_decodes, int(num_sched.max()), int(seq_lens.max()))
        return metadata, seq_lens

    def _publish(
        self, num_tokens: int, num_reqs: int, num_actual_tokens: int, num_decodes: int, max_query_len: int,
        max_seq_len: int,
    ) -> AttentionMetadata:
        """Copy the filled host buffers to the device and describe them (views from the start of
        each buffer, so addresses never change)."""
        self.input_ids.copy_to_device(num_tokens)
        self.positions.copy_to_device(num_tokens)
        metadata = AttentionMetadata(
            num_actual_tokens=num_actual_tokens,
            num_reqs=num_reqs,
            num_decodes=num_decodes,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc.copy_to_device(num_reqs + 1),
            seq_lens=self.seq_lens.copy_to_device(num_reqs),
            block_tables=self.block_tables.copy_to_device(num_reqs),
            slot_mapping=self.slot_mapping.copy_to_device(num_tokens),
            query_start_loc_cpu=self.query_start_loc.np[: num_reqs + 1],
            seq_lens_cpu=self.seq_lens.np[:num_reqs],
        )
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        return metadata

    # ---- sampling inputs ----------------------------------------------------------------------
    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        batch = self.batch
        temps = batch.temperature[rows]
        all_greedy = bool((temps < 1e-5).all())
        meta = SamplingMetadata(temperature=None if all_greedy else torch.from_numpy(temps), all_greedy=all_greedy)
        params = [batch.params[r] for r in rows]
        if not all_greedy:
            top_k = batch.top_k[rows]
            if top_k.any():
                meta.top_k = torch.from_numpy(top_k)
            top_p = batch.top_p[rows]
            if (top_p < 1.0).any():
                meta.top_p = torch.from_numpy(top_p)
            min_p = batch.min_p[rows]
            if min_p.any():
                meta.min_p = torch.from_numpy(min_p)
            meta.generators = {i: batch.generators[r] for i, r in enumerate(rows.tolist()) if r in batch.generators}
        wanted = [p.logprobs for p in params if p.logprobs is not None]  # type: ignore[union-attr]
        meta.max_num_logprobs = max(wanted) if wanted else None
        self._penalties(rows, meta)
        for i, (row, p) in enumerate(zip(rows.tolist(), params)):
            if p.min_tokens and batch.num_tokens[row] - batch.num_prompt_tokens[row] < p.min_tokens:  # type: ignore[union-attr]
                banned = list(p.stop_token_ids or [])  # type: ignore[union-attr]
                if not p.ignore_eos:  # type: ignore[union-attr]
                    banned += self.eos_token_ids
                if banned:
                    meta.banned_token_ids.append((i, banned))
        if self.device.type != "cpu":
            for name in ("temperature", "top_k", "top_p", "min_p"):
                value = getattr(meta, name)
                if value is not None:
                    setattr(meta, name, value.to(self.device, non_blocking=True))
        return meta

    def _penalties(self, rows: np.ndarray, meta: SamplingMetadata) -> None:
        batch = self.batch
        presence, frequency = batch.presence_penalty[rows], batch.frequency_penalty[rows]
        repetition = batch.repetition_penalty[rows]
        use_pf = bool(presence.any() or frequency.any())
        use_rep = bool((repetition != 1.0).any())
        if not (use_pf or use_rep):
            return
        num = len(rows)
        counts = torch.zeros(num, self.vocab_size, dtype=torch.float32)
        seen = torch.zeros(num, self.vocab_size, dtype=torch.bool) if use_rep else None
        for i, row in enumerate(rows.tolist()):
            prompt_len, n = int(batch.num_prompt_tokens[row]), int(batch.num_tokens[row])
            out_ids = torch.from_numpy(batch.token_ids[row, prompt_len:n])
            counts[i].index_add_(0, out_ids, torch.ones(len(out_ids)))
            if seen is not None:
                seen[i, torch.from_numpy(batch.token_ids[row, :n])] = True
        dev = self.device
        meta.output_token_counts = counts.to(dev)
        if use_pf:
            meta.presence_penalty = torch.from_numpy(presence).to(dev)
            meta.frequency_penalty = torch.from_numpy(frequency).to(dev)
        if use_rep:
            meta.repetition_penalty = torch.from_numpy(repetition).to(dev)
            meta.seen_token_mask = seen.to(dev)  # type: ignore[union-attr]

    def _logprobs_lists(self, result: SamplerOutput, req_ids: list[str], rows: np.ndarray) -> dict[str, LogprobsLists]:
        ids = result.logprob_token_ids.tolist()  # type: ignore[union-attr]
        lps = result.logprobs.tolist()  # type: ignore[union-attr]
        ranks = result.sampled_ranks.tolist()  # type: ignore[union-attr]
        out = {}
        for i, (rid, row) in enumerate(zip(req_ids, rows.tolist())):
            k = self.batch.params[row].logprobs  # type: ignore[union-attr]
            if k is None:
                continue
            out[rid] = LogprobsLists([ids[i][: k + 1]], [lps[i][: k + 1]], [ranks[i]])
        return out

    # ---- start-up ----------------------------------------------------------------------------
    def compile_or_warm_up(self) -> None:
        """At -O1 and above: compile (or load) every piece now; at -O2 on a GPU also capture the
        CUDA graphs. Nothing is compiled or captured later, while serving."""
        if self.config.compilation_config.level:
            self.compile()
        if self.captures_cudagraphs:
            self.capture_cudagraphs()

    @property
    def captures_cudagraphs(self) -> bool:
        """-O2 on a GPU with a CUDA-graph mode: graphs are captured at start-up."""
        cc = self.config.compilation_config
        return self.device.type == "cuda" and (cc.level or 0) >= 2 and cc.cudagraph_mode is not CUDAGraphMode.NONE

    def compile(self) -> None:
        cc = self.config.compilation_config
        if self.max_num_tokens < 2:
            raise ValueError("compilation needs max_num_batched_tokens >= 2")
        from compiled_llm.compilation.compiled_forward import CompiledForward

        cache = make_compile_cache(self.config, self.model)
        self.compiled_forward = CompiledForward(self.model, cc, cache, self.max_num_tokens)
        num_tokens = min(self.max_num_tokens, 16)
        with torch.inference_mode(), set_forward_context(self.dummy_metadata(num_tokens)):
            self.compiled_forward.trace(self.input_ids.gpu[:num_tokens], self.positions.gpu[:num_tokens])
        self.model_forward = self.compiled_forward
        r = self.compiled_forward.report
        how = "traced with Dynamo and " + ("compiled" if r.inductor_compilations else "loaded") if r.traced else "loaded the saved graph"
        logger.info(
            "Compilation (-O%d): %s in %.2f s; %d pieces (%d unique); %d artifacts loaded, "
            "%d Inductor compilations; cache %s",
            cc.level, how, self.compiled_forward.seconds, r.pieces, r.unique_pieces, r.artifacts_loaded,
            r.inductor_compilations, r.cache_dir,
        )

    def capture_cudagraphs(self) -> None:
        """Capture every graph the dispatcher can pick, largest first, into one memory pool."""
        from compiled_llm.compilation.counters import counters
        from compiled_llm.compilation.cuda_graph import CUDAGraphWrapper, capture_phase

        cc = self.config.compilation_config
        sizes = [s for s in cc.cudagraph_capture_sizes or [] if s <= self.max_num_tokens]
        self.dispatcher = CudagraphDispatcher(sizes, cc.cudagraph_mode, self.max_num_reqs)
        if cc.cudagraph_mode.has_full_cudagraphs():
            self.model_forward = CUDAGraphWrapper(self.model_forward, CUDAGraphMode.FULL, name="model")
        started, captured = time.perf_counter(), counters.num_cudagraph_captured
        free_before = torch.cuda.mem_get_info()[0]
        with torch.inference_mode(), capture_phase():
            for mode, descriptor in self.dispatcher.capture_descriptors():
                metadata = self.dummy_metadata(descriptor.num_tokens, descriptor.num_reqs or 1)
                with set_forward_context(metadata, mode, descriptor):
                    self.model_forward(self.input_ids.gpu[: descriptor.num_tokens], self.positions.gpu[: descriptor.num_tokens])
        torch.cuda.synchronize()
        logger.info(
            "CUDA graphs (%s): %d captured for %d sizes up to %d tokens in %.2f s, using %.2f GiB.",
            cc.cudagraph_mode.name, counters.num_cudagraph_captured - captured, len(sizes), max(sizes, default=0),
            time.perf_counter() - started, (free_before - torch.cuda.mem_get_info()[0]) / (1 << 30),
        )

    def dummy_metadata(self, num_tokens: int, num_reqs: int = 1, query_lens: list[int] | None = None) -> AttentionMetadata:
        """`num_reqs` requests sharing `num_tokens` fresh tokens (or requests of `query_lens`) that
        write nothing to the KV cache (slot -1, the null block): for tracing, capturing graphs and
        profiling."""
        if query_lens is None:
            per_req = num_tokens // num_reqs
            query_lens = [per_req] * (num_reqs - 1) + [num_tokens - per_req * (num_reqs - 1)]
        query_lens = np.asarray(query_lens, dtype=np.int64)
        num_reqs = len(query_lens)
        starts = np.concatenate([[0], np.cumsum(query_lens)])
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        self.input_ids.np[:num_tokens] = 0
        self.positions.np[:num_tokens] = np.concatenate([np.arange(n) for n in query_lens])
        self.slot_mapping.np[:num_tokens] = -1
        self.query_start_loc.np[: num_reqs + 1] = starts
        self.seq_lens.np[:num_reqs] = query_lens
        self.block_tables.np[:num_reqs] = 0
        longest = int(query_lens.max())
        num_decodes = num_reqs if longest == 1 else 0
        return self._publish(num_tokens, num_reqs, num_tokens, num_decodes, longest, longest)


def uses_cpu_kernels(config: EngineConfig) -> bool:
    """Whether the model calls the C++ CPU kernels: fp32 on a CPU, where they can be built."""
    if config.torch_device.type != "cpu" or config.model_config.dtype != torch.float32:
        return False
    from compiled_llm.kernels.cpu_extension import cpu_kernels_available

    return cpu_kernels_available()


def compile_cache_factors(config: EngineConfig, model: torch.nn.Module | None = None) -> dict:
    """The factors of the compile cache key; builds the model on the meta device if none is given."""
    from compiled_llm.compilation.cache_key import compute_factors, model_sources, package_sources
    from compiled_llm.models.registry import model_class

    mc = config.model_config
    if model is None:
        with torch.device("meta"):
            model = model_class(mc.architecture)(mc.hf_config)
    return compute_factors(
        hf_config=mc.hf_config,
        dtype=mc.dtype,
        device=config.torch_device,
        compilation_config=config.compilation_config,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        source_files=package_sources() + model_sources(model),
        cpu_kernels=uses_cpu_kernels(config),  # what the runner sets on the model's layers
    )


def make_compile_cache(config: EngineConfig, model: torch.nn.Module | None = None):
    from compiled_llm.compilation.cache_key import cache_key
    from compiled_llm.compilation.compile_cache import CompileCache

    factors = compile_cache_factors(config, model)
    return CompileCache(config.compilation_config.cache_dir, cache_key(factors), factors)
