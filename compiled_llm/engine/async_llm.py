"""`AsyncLLM`: the asyncio frontend that the OpenAI server drives.

Tokenizes and validates on a worker thread (the event loop keeps serving meanwhile), sends the
request to the engine core process, and runs one output-handler task that turns engine outputs
into `RequestOutput`s (incremental detokenization, stop strings, `n > 1`) and hands each to its
request's stream. Aborts (a client that went away, a stop string found here) go back to the
engine at once so that its KV blocks are freed. If the engine dies, every open stream fails with
`EngineDeadError` and `errored` turns true.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncGenerator, Callable, Iterable

from compiled_llm.config import EngineConfig
from compiled_llm.engine.admission import AdmissionLimits, EngineBusyError
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.chat_templates import ChatTemplateRenderer
from compiled_llm.engine.core_client import AsyncMPClient, EngineDeadError
from compiled_llm.engine.dp_client import DPAsyncMPClient
from compiled_llm.engine.engine_process import EngineHandle
from compiled_llm.engine.metrics import DEFAULT_NAMESPACE, EngineMetrics
from compiled_llm.engine.output_processor import OutputProcessor
from compiled_llm.engine.processor import Processor, PromptType
from compiled_llm.engine.tokenizer import get_tokenizer
from compiled_llm.logger import init_logger
from compiled_llm.lora.request import LoRARequest
from compiled_llm.messages.engine_core import EngineCoreOutput
from compiled_llm.outputs import PoolingRequestOutput, RequestOutput
from compiled_llm.pooling_params import PoolingParams
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams
from compiled_llm.structured_output_spec import GRAMMAR_TIME_LIMIT_S, validate_structured_outputs

logger = init_logger(__name__)


class RequestStream:
    """One request's outputs, from the output handler to its reader.

    Outputs not read yet are merged into one (deltas appended, cumulative outputs replaced), so a
    slow reader holds one pending output rather than a growing queue. With a `stream_interval` of
    N > 1 (delta outputs), the reader is woken for the first output, then once N new tokens are
    pending, and for the last output or an error: a streaming client gets one event per N tokens,
    and the server one socket write and one wake-up per N tokens instead of per token.
    """

    def __init__(
        self, request_id: str, aggregate: bool, on_done: Callable[[str], Any], stream_interval: int = 1
    ) -> None:
        self.request_id = request_id
        self.engine_ids: list[str] = []
        self._aggregate = aggregate
        self._on_done = on_done
        self._interval = stream_interval if aggregate else 1
        self._pending: RequestOutput | BaseException | None = None
        self._pending_tokens = 0
        self._woken = False  # the reader was woken at least once (the first output goes at once)
        self._ready = asyncio.Event()
        self._done = False  # the last output (or an error) has been put
        self.finished = False  # ... and read

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._done:
            return
        if isinstance(item, RequestOutput) and isinstance(self._pending, RequestOutput):
            self._pending.add(item, self._aggregate)
        else:
            self._pending = item
        if isinstance(item, BaseException) or item.finished:
            self._done = True
            self._on_done(self.request_id)
        elif self._interval > 1:  # (counting costs a pass over the outputs: not at the default 1)
            self._pending_tokens += sum(len(c.token_ids) for c in item.outputs)
            if self._woken and self._pending_tokens < self._interval:
                return  # wait for more tokens
        self._woken = True
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._pending_tokens = 0
        self._ready.clear()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert item is not None
        self.finished = item.finished
        return item


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, engine_timeout_s: float = 120.0, stream_interval: int = 1,
        engine: EngineHandle | None = None, client_index: int = 0, wait_ready: bool = True,
        admission: AdmissionLimits | None = None, metrics_namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        """`stream_interval`: streamed (delta) requests get their tokens in events of this many
        (the first and the last event excepted): fewer writes and wake-ups per token, coarser ITL.
        `engine`, `client_index`: an engine core started already (by this process, or by another
        one for several API server processes to share), and this one's place among them (default:
        start our own engine). `wait_ready=False`: return while the engine still loads; call
        `wait_ready()` before serving (the caller's own start-up overlaps the engine's).
        `admission`: the limits past which a request is refused with EngineBusyError (default: none).
        `metrics_namespace`: the Prometheus metrics' prefix (`compiled_llm`, or `vllm` for vLLM's
        dashboards)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}.")
        self.stream_interval = stream_interval
        self.admission = admission
        self._admitting = 0  # sequences admitted whose requests are still being tokenized and registered
        self.config = config
        self.model_config = config.model_config
        # One engine core process, or a data-parallel group of them behind this frontend. A single
        # engine starts first, so that it loads the model while this process loads the tokenizer.
        single = config.parallel_config.data_parallel_size == 1
        client = (AsyncMPClient(config, engine_timeout_s, engine=engine, client_index=client_index, wait_ready=False)
                  if single else None)
        try:
            self.tokenizer = get_tokenizer(config.model_config.tokenizer)
            self.processor = Processor(self.model_config, self.tokenizer, config.scheduler_config.policy,
                                       config.lora_config)
            self.output_processor = OutputProcessor(self.tokenizer)
            self.metrics = EngineMetrics(self.model_config.served_model_name, self.model_config.max_model_len,
                                         config.parallel_config.data_parallel_size, metrics_namespace)
            if client is None:
                client = DPAsyncMPClient(config, engine_timeout_s)
        except BaseException:
            if client is not None:
                client.shutdown()
            raise
        self.client: AsyncMPClient | DPAsyncMPClient = client
        self.output_processor.on_output = self.metrics.on_output
        # One thread: HF tokenizers are not meant to be used from several threads at once.
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # Structured outputs constraints are parsed in their own thread (xgrammar releases the GIL):
        # a costly one never holds up other requests' tokenization.
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")
        self.chat_renderer: ChatTemplateRenderer | None = None
        self._ready = False
        self._shut_down = False
        self._streams: dict[str, RequestStream] = {}
        self._handler: asyncio.Task | None = None
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the engine is ready; `EngineStartupError` (and the engine stopped) if not."""
        if self._ready:
            return
        if isinstance(self.client, AsyncMPClient):  # a data-parallel group waited for its engines
            self.client.wait_ready()
        self.metrics.record_cache_config(self.config.cache_config, getattr(self.client, "num_blocks", None),
                                         self.config.parallel_config.data_parallel_size)
        self._ready = True

    def start_chat_renderer(self) -> None:
        """Start the chat template's render workers (else the first render starts them). The
        server does so once it listens: three process starts would otherwise sit between the
        engine's readiness and the server's."""
        if self.chat_renderer is None and not self._shut_down:
            self.chat_renderer = ChatTemplateRenderer(self.config.model_config.tokenizer)

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, engine_timeout_s: float = 120.0, stream_interval: int = 1, **kwargs: Any
    ) -> "AsyncLLM":
        """Start the engine core process and wait until it is ready (model loaded, compiled);
        `kwargs`: the constructor's others (`admission`, `metrics_namespace`)."""
        return cls(args.create_engine_config(), engine_timeout_s, stream_interval, **kwargs)

    # ---- state -------------------------------------------------------------------------------
    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.client.dead_error

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._handler is not None and not self._handler.done()

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    async def wait_until_dead(self) -> EngineDeadError:
        return await self.client.wait_until_dead()

    def start(self) -> None:
        """Start the output handler on the running loop (the first request starts it otherwise);
        until it runs, the engine's death goes unnoticed."""
        if self._handler is None:
            self._handler = asyncio.get_running_loop().create_task(self._handle_outputs(), name="AsyncLLMOutputs")

    # ---- requests ----------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and send a request (PoolingParams: a pooling request, one output; `lora_request`:
        the adapter it runs with); raises ValueError for a bad one before anything is queued."""
        arrival = time.time()
        await self.check_health()
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        # Admitted requests count from here, though they join the output processor's only once
        # tokenized: a burst of requests all checked before the first is registered is bounded too.
        admitted = params.n if isinstance(params, SamplingParams) else 1  # sequences: one per sample
        if self.admission is not None:
            try:
                self.admission.check(self.output_processor.states, admitted, self._admitting)
            except EngineBusyError as e:
                self.metrics.record_admission_rejection(e.reason)
                raise
        delta = isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.DELTA
        stream = RequestStream(request_id, delta, self._forget, self.stream_interval)
        self._streams[request_id] = stream
        self._admitting += admitted
        try:
            loop = asyncio.get_running_loop()
            request, text = await loop.run_in_executor(
                self._tokenizer_pool, functools.partial(self.processor.process, lora_request=lora_request),
                request_id, prompt, params, arrival, priority, False,
            )
            if isinstance(params, SamplingParams) and params.structured_outputs is not None:
                await self._check_grammar(params)
            await self.check_health()
            self.start()
            children = self.output_processor.add_user_request(request, text, queue=stream)
            stream.engine_ids.extend(child.request_id for child in children)
            for child in children:
                await self.client.add_request_async(child)
        except BaseException:
            self._streams.pop(request_id, None)
            self.output_processor.abort_requests(stream.engine_ids)
            raise
        finally:
            self._admitting -= admitted
        return stream

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request as they come (as `sampling_params.output_kind` asks); leaving the
        loop early, or being cancelled, aborts the request in the engine."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority, lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            await self.abort(request_id)

    async def encode(
        self, prompt: PromptType, pooling_params: PoolingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request's one output (vLLM's name); leaving early aborts it in the engine."""
        stream = await self.add_request(request_id, prompt, pooling_params, priority)
        try:
            async for output in stream:
                yield output  # type: ignore[misc]
        finally:
            await self.abort(request_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort open requests (unknown or finished ids are ignored); their readers get a last
        output with finish reason "abort", and the engine frees their blocks."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        engine_ids = [eid for rid in ids if (s := self._streams.get(rid)) is not None for eid in s.engine_ids]
        if not engine_ids:
            return
        self.output_processor.process_outputs([EngineCoreOutput(eid, [], finish_reason="abort") for eid in engine_ids])
        await self.client.abort_requests_async(engine_ids)

    async def abort_all(self) -> None:
        await self.abort(list(self._streams))

    async def begin_shutdown(self) -> None:
        """The server is stopping: end every open request now, and take the engine's exit from
        here on (it gets the same Ctrl-C) for part of the shutdown rather than a death."""
        self.client.expect_exit()
        await self.abort_all()

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def reset_prefix_cache(self) -> bool:
        return await self.client.reset_prefix_cache_async()

    async def _check_grammar(self, params: SamplingParams) -> None:
        """Parse the request's constraint (ValueError for a bad one, or one that takes longer than
        `GRAMMAR_TIME_LIMIT_S`: the engine's compilation would take as long again)."""
        check = asyncio.get_running_loop().run_in_executor(self._grammar_pool, validate_structured_outputs, params)
        try:
            await asyncio.wait_for(check, GRAMMAR_TIME_LIMIT_S)
        except TimeoutError:
            raise ValueError(
                f"The structured outputs constraint took longer than {GRAMMAR_TIME_LIMIT_S:g} s to parse: it is too "
                "complex to compile in reasonable time."
            ) from None

    # ---- tokenizer work, off the event loop --------------------------------------------------
    async def _in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a text too long for the context is refused (ValueError) unread."""
        self.processor.check_text_size(text)
        return await self._in_tokenizer_thread(self.processor.encode, text, add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._in_tokenizer_thread(self.tokenizer.decode, token_ids)

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        add_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> tuple[str, list[int]]:
        """Render a conversation with the model's chat template (or `chat_template`) in a render
        worker, within its deadline; returns (text, token ids). `template_kwargs` reach the
        template (`tools`, `documents`, `continue_final_message`, ...). `add_special_tokens`: add
        the tokenizer's own (BOS) on top of what the template wrote (off: templates write them).
        Raises `ChatTemplateError` (a ValueError) when the template fails and ValueError when the
        text cannot fit."""
        assert self._ready, "wait_ready() first"
        self.start_chat_renderer()
        assert self.chat_renderer is not None, "the engine is shut down"
        text = await self.chat_renderer.render(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return text, await self.tokenize(text, add_special_tokens=add_special_tokens)

    # ---- the output handler ------------------------------------------------------------------
    async def _handle_outputs(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output_async()
                self.metrics.engine = outputs.engine_index  # the per-request metrics of this batch's engine
                if outputs.outputs:
                    processed = self.output_processor.process_outputs(outputs.outputs)
                    if processed.reqs_to_abort:
                        await self.client.abort_requests_async(processed.reqs_to_abort)
                if outputs.scheduler_stats is not None:
                    self.metrics.record_scheduler_stats(outputs.scheduler_stats, outputs.engine_index)
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:
            logger.exception("The output handler failed.")
            self._fail_all(EngineDeadError(f"The output handler failed: {e}"))

    def _fail_all(self, error: EngineDeadError) -> None:
        self.client.mark_dead(error)
        self._end_streams(self.dead_error or error)

    def _end_streams(self, error: EngineDeadError) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        self.output_processor.abort_requests(list(self.output_processor.states))
        for stream in streams:
            stream.put(EngineDeadError(str(error)))

    def shutdown(self) -> None:
        """Stop the engine process (joined) and end any stream still open with an error."""
        self._shut_down = True
        if self._handler is not None and not self._handler.done() and not self._handler.get_loop().is_closed():
            self._handler.cancel()
        self._end_streams(EngineDeadError("The engine was shut down."))
        self.client.shutdown()
        if self.chat_renderer is not None:
            self.chat_renderer.shutdown()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
