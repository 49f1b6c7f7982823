"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
from typing import Any, Sequence, Union

from tqdm.auto import tqdm

from compiled_llm.compilation.compile_cache import drop_read_ahead
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.llm_engine import LLMEngine
from compiled_llm.engine.processor import PromptType
from compiled_llm.entrypoints.beam_search import BeamSearch, BeamSearchOutput, run_sync
from compiled_llm.entrypoints.chat_utils import (
    ChatTemplateContentFormatOption,
    format_content,
    load_chat_template,
    resolve_content_format,
)
from compiled_llm.entrypoints.score_utils import cosine_score, pair_up
from compiled_llm.lora.request import LoRARequest
from compiled_llm.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from compiled_llm.pooling_params import PoolingParams
from compiled_llm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from compiled_llm.utils import gc_paused
from compiled_llm.worker.cache_factors import start_reading_packed_weights

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate text offline, in batches, with the engine in this process.

    `model`: a Hugging Face folder (default: the bundled SmolLM2-135M-Instruct). The keyword
    arguments are `EngineArgs` fields, with the same names and defaults as the command-line flags
    (`optimization_level`: 0 eager, 1 compiled pieces, 2 pieces + CUDA graphs, None for 1 on a CPU
    and 2 on a GPU; `compile_cache`, `max_model_len`, `kv_cache_memory_bytes`, `dtype`, ...).
    `chat_template`: the template `chat` uses instead of the model's (a file, or the template itself).
    """

    def __init__(self, model: str | None = None, chat_template: str | None = None, **engine_args: Any) -> None:
        self.chat_template = load_chat_template(chat_template)  # a bad path fails before the model loads
        with gc_paused():  # the engine's objects are made once and live as long as it does
            config = EngineArgs(model=model, **engine_args).create_engine_config()
            # The engine's rank 0 runs in this process: its packed weights' read overlaps the tokenizer's
            # load and the engine's imports (0.1-0.2 s of a warm start), not only the model's construction.
            start_reading_packed_weights(config)
            try:
                self.llm_engine = LLMEngine(config)
            except BaseException:
                drop_read_ahead()  # no runner took them
                raise
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. `priority`: one per prompt, lower first (needs
        `scheduling_policy="priority"`). `lora_request`: the adapter every prompt runs with, or one
        per prompt (None: the base model); needs `enable_lora=True`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt."
                )
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"Got {len(priorities)} priorities for {len(prompts)} prompts; pass one per prompt.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"Got {len(loras)} LoRA requests for {len(prompts)} prompts; pass one, or one per "
                                 "prompt.")
        return self._run(prompts, params_list, use_tqdm, priorities, loras)

    def encode(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt's final hidden states (a model served with `runner="pooling"`): one
        forward, no sampling. Default `PoolingParams(task="encode")`: the pooled vector as it is;
        `pooling_task` ("encode", "embed", "token_embed": one embedding per token) sets the task.
        `truncate_prompt_tokens`: keep the last k tokens (-1: max_model_len)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):  # one prompt as token ids
            prompts = [prompts]  # type: ignore[list-item]
        params = pooling_params or PoolingParams(task="encode")
        if pooling_task is not None:
            params = params.clone(task=pooling_task)
        if truncate_prompt_tokens is not None:
            prompts = [self._truncated(prompt, truncate_prompt_tokens) for prompt in prompts]
        return self._run(prompts, [params] * len(prompts), use_tqdm, [0] * len(prompts))  # type: ignore[return-value]

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (`outputs.embedding`), normalised as the pooler config says."""
        params = (pooling_params or PoolingParams()).clone(task="embed")
        outputs = self.encode(prompts, params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """The score of each pair (one `data_1` against every `data_2`, or pairwise): for an embed
        model, as vLLM, the cosine similarity of the two embeddings."""
        pairs = pair_up(data_1, data_2)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        embedded = self.encode(texts, (pooling_params or PoolingParams()).clone(task="embed"),
                               truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        by_text = dict(zip(texts, embedded))
        return [
            ScoringRequestOutput(str(i), ScoringOutput(cosine_score(by_text[a].outputs.data, by_text[b].outputs.data)),
                                 by_text[a].prompt_token_ids + by_text[b].prompt_token_ids, True)
            for i, (a, b) in enumerate(pairs)
        ]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], **kwargs: Any) -> list[Any]:
        """Classification needs a classification head, which none of the decoders served here has."""
        config = self.llm_engine.config.model_config
        raise ValueError(f"LLM.classify needs a model with a classification head; {config.architecture} has none "
                         "(served with --convert embed it embeds: use embed or score).")

    def _truncated(self, prompt: PromptType, k: int) -> PromptType:
        """The prompt's last `k` tokens (-1: max_model_len), as token ids."""
        max_len = self.llm_engine.config.model_config.max_model_len
        k = max_len if k == -1 else k
        if not 0 < k <= max_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or within 1..max_model_len ({max_len}), got {k}.")
        text, ids = self.llm_engine.processor.tokenize(prompt)
        return {"prompt": text, "prompt_token_ids": ids[-k:]} if text is not None else ids[-k:]

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_content_format: ChatTemplateContentFormatOption = "auto",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, rendered with `chat_template` (a file or the
        template), else the one given to `LLM`, else the model's; message content reaches the
        template as a string or as a list of text parts (`chat_template_content_format`, as vLLM)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        template = load_chat_template(chat_template) or self.chat_template
        content_format = resolve_content_format(chat_template_content_format, template or tokenizer.chat_template)
        prompts: list[PromptType] = []
        for conversation in conversations:
            conversation = [{**m, "content": format_content(m.get("content"), content_format)} for m in conversation]
            text = tokenizer.apply_chat_template(
                conversation, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` best sequences of each prompt by beam search, best first (vLLM's
        `LLM.beam_search`). As in vLLM, a sequence's `tokens` and `text` include its prompt. The
        searches run side by side: each step is one batch of every live beam of every prompt."""
        if isinstance(prompts, (str, dict)) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # type: ignore[list-item]
        engine = self.llm_engine
        searches = [BeamSearch(engine.processor.tokenize(prompt)[1], params, engine.config.model_config)
                    for prompt in prompts]
        bar = tqdm(total=params.max_tokens, desc="Beam search", unit="step", disable=not use_tqdm)

        def step(step_prompts: list[list[int]], step_params: list[SamplingParams]) -> list[RequestOutput]:
            bar.update(1)
            return self.generate(step_prompts, step_params, use_tqdm=False)  # type: ignore[arg-type]

        try:
            run_sync(searches, step)
        finally:
            bar.close()
        return [search.output(self.get_tokenizer().decode) for search in searches]

    def _run(
        self, prompts: list[PromptType], params_list: Sequence[SamplingParams | PoolingParams], use_tqdm: bool,
        priorities: list[int], loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        # Validate everything first: a bad prompt raises before any request is queued.
        processed = []
        for prompt, params, priority, lora in zip(prompts, params_list, priorities, loras or [None] * len(prompts)):
            if isinstance(params, SamplingParams):
                params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            processed.append(engine.process(str(next(self._ids)), prompt, params, priority=priority,
                                            lora_request=lora))
        order = {request.request_id: i for i, (request, _) in enumerate(processed)}
        try:
            for request, text in processed:
                engine.add_processed(request, text)
        except ValueError:  # the engine refused one: the batch's earlier requests must not stay queued
            engine.abort_request([request.request_id for request, _ in processed])
            raise
        results: list[RequestOutput | PoolingRequestOutput | None] = [None] * len(processed)
        bar = tqdm(total=len(processed), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        bar.update(1)
                        if isinstance(out, RequestOutput):
                            generated += sum(len(c.token_ids) for c in out.outputs)
                            rate = generated / max(bar.format_dict['elapsed'], 1e-9)
                            bar.set_postfix_str(f"output {rate:.1f} tok/s")
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]
