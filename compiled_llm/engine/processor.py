"""Turns a user's prompt and sampling params into a validated `EngineCoreRequest`."""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any, Union

from compiled_llm.config import LoRAConfig, ModelConfig
from compiled_llm.lora.peft_adapter import check_fits, load_peft_adapter
from compiled_llm.lora.request import LoRARequest
from compiled_llm.messages.engine_core import EngineCoreRequest
from compiled_llm.pooling_params import PoolingParams
from compiled_llm.sampling_params import SamplingParams
from compiled_llm.structured_output_spec import validate_structured_outputs

# A pooling request's sampling params: none of them is used (the runner samples nothing).
_POOLING_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)

# A prompt: text, token ids, or vLLM's dict forms.
PromptType = Union[str, list[int], dict[str, Any]]


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, scheduling_policy: str = "fcfs",
                 lora_config: LoRAConfig | None = None) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        self._checked_loras: set[tuple[int, str]] = set()  # (id, path) of adapters read and found to fit
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        # The embedding's rows: a larger id cannot be looked up (a tokenizer may know more tokens).
        self.vocab_size = model_config.vocab_size

    @cached_property
    def max_prompt_bytes(self) -> int:
        """No text longer than this fits in `max_model_len` tokens: no token spells more than the
        longest vocabulary entry (in UTF-8, which is at least the bytes it covers for byte-level
        BPE and SentencePiece vocabularies alike). A longer text is refused before the tokenizer
        spends seconds on it."""
        longest = max((len(token.encode("utf-8", "replace")) for token in self.tokenizer.get_vocab()), default=1)
        return self.model_config.max_model_len * max(longest, 1)

    def check_text_size(self, text: str) -> None:
        if len(text) * 4 < self.max_prompt_bytes:  # a character is at most 4 UTF-8 bytes
            return
        size = len(text.encode("utf-8", "replace"))
        if size > self.max_prompt_bytes:
            raise ValueError(
                f"The prompt is {size} bytes long: more than fits in the maximum context length of "
                f"{self.model_config.max_model_len} tokens (at most {self.max_prompt_bytes} bytes)."
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, refusing (ValueError) a text too long to fit before tokenizing it."""
        self.check_text_size(text)
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                text = prompt["prompt"]
                return text, self.encode(text)
            raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}; use a string, token ids or a dict.")

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        check_grammar: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """`check_grammar=False`: the caller parses the structured outputs constraint itself
        (`validate_structured_outputs`), elsewhere than where it tokenizes."""
        if priority and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority={priority} needs the priority scheduling policy (--scheduling-policy priority)."
            )
        pooling = isinstance(params, PoolingParams)
        if pooling != (self.model_config.runner == "pooling"):
            raise ValueError(
                "This model is served by the pooling runner (--runner pooling): it embeds prompts and generates "
                "no text; use the embeddings, pooling, score or rerank APIs." if not pooling else
                "This model is served to generate text: embeddings and pooling need --runner pooling --convert embed."
            )
        self.check_lora(lora_request)
        text, token_ids = self.tokenize(prompt)
        if isinstance(params, PoolingParams):  # prompt-only: one forward, nothing sampled
            self.validate(token_ids, _POOLING_SAMPLING)
            params.verify(self.model_config.hf_config.hidden_size, self.model_config.hf_config)
            return EngineCoreRequest(request_id, token_ids, _POOLING_SAMPLING, arrival_time or time.time(), priority,
                                     pooling_params=params), text
        params = self.validate(token_ids, params, check_grammar)
        request = EngineCoreRequest(request_id, token_ids, params, arrival_time or time.time(), priority,
                                    lora_request=lora_request)
        return request, text

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """Refuse (ValueError naming the problem) an adapter the engine could not load: LoRA off, an
        unreadable or unsupported adapter, a rank above max_lora_rank, one made for another model.
        Each adapter is read once here; the engine trusts what passed."""
        if lora_request is None:
            return
        if self.lora_config is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: this engine runs without LoRA "
                             "(start it with enable_lora / --enable-lora).")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key in self._checked_loras:
            return
        adapter = load_peft_adapter(lora_request.lora_path, self.lora_config.max_lora_rank)
        check_fits(adapter, self.model_config.hf_config)
        self._checked_loras.add(key)

    def validate(self, token_ids: list[int], params: SamplingParams, check_grammar: bool = True) -> SamplingParams:
        """Check the request against the model; returns params with `max_tokens` filled in."""
        max_len = self.model_config.max_model_len
        if not token_ids:
            raise ValueError("The prompt is empty.")
        if len(token_ids) > max_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, longer than the maximum context length "
                f"of {max_len} tokens."
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocabulary size {self.vocab_size}).")
        bad = [t for t in params.stop_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]}, outside the vocabulary (size {self.vocab_size}).")
        limit = self.model_config.max_logprobs
        if params.logprobs is not None and 0 <= limit < params.logprobs:  # -1: no limit
            raise ValueError(f"logprobs must be at most {limit}, got {params.logprobs}.")
        params.verify_for_model(self.vocab_size, limit)
        if check_grammar:
            validate_structured_outputs(params)  # a bad schema, regex or grammar: ValueError naming it
        room = max_len - len(token_ids)
        if params.max_tokens is None:
            params = params.clone(max_tokens=max(room, 1))
        return params
