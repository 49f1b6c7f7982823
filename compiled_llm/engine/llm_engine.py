"""`LLMEngine`: the synchronous engine behind the offline `LLM` API.

Processor (tokenize, validate) -> in-process `EngineCore` -> `OutputProcessor` (detokenize,
stop strings), stepped by the caller.
"""

from __future__ import annotations

from typing import Any

from compiled_llm.config import EngineConfig
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.core_client import InprocClient
from compiled_llm.engine.output_processor import OutputProcessor
from compiled_llm.engine.processor import Processor, PromptType
from compiled_llm.engine.tokenizer import get_tokenizer
from compiled_llm.lora.request import LoRARequest
from compiled_llm.messages.engine_core import EngineCoreRequest
from compiled_llm.outputs import RequestOutput
from compiled_llm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 runs several engine processes behind `compiled-llm serve`; the offline "
                "LLM steps one engine (use tensor_parallel_size to spread one model over several ranks)."
            )
        self.config = config
        self.tokenizer = get_tokenizer(config.model_config.tokenizer)
        self.processor = Processor(config.model_config, self.tokenizer, config.scheduler_config.policy,
                                   config.lora_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core_client = InprocClient(config)
        self.engine_core = self.engine_core_client.engine_core  # direct access for tests and tools
        self._engine_ids: dict[str, list[str]] = {}  # user id -> engine ids (n > 1 has several)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Tokenize and validate without adding: raises ValueError for a bad request."""
        return self.processor.process(request_id, prompt, params, arrival_time, priority, lora_request=lora_request)

    def add_processed(self, request: EngineCoreRequest, prompt: str | None) -> None:
        external_id = request.request_id
        if external_id in self._engine_ids:
            raise ValueError(f"Request id {external_id!r} is already in use.")
        children = self.output_processor.add_user_request(request, prompt)
        self._engine_ids[external_id] = [child.request_id for child in children]
        try:
            for child in children:
                self.engine_core_client.add_request(child)
        except ValueError:  # the engine refused it (e.g. a LoRA adapter whose folder is gone): nothing stays queued
            self.abort_request([external_id])
            raise

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> None:
        self.add_processed(*self.process(request_id, prompt, params, priority=priority))

    def abort_request(self, request_ids: list[str]) -> None:
        engine_ids = [eid for rid in request_ids for eid in self._engine_ids.pop(rid, [])]
        self.output_processor.abort_requests(engine_ids)
        self.engine_core_client.abort_requests(engine_ids)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core_client.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core_client.abort_requests(processed.reqs_to_abort)
        for out in processed.request_outputs:
            if out.finished:
                self._engine_ids.pop(out.request_id, None)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core_client.has_unfinished_requests()

    def get_tokenizer(self) -> Any:
        return self.tokenizer
