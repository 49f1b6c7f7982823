"""POST /tokenize and /detokenize (vLLM's routes): the server's tokenizer, for clients that
count or cut tokens themselves. /tokenize takes a prompt, or chat messages with the chat
options of /v1/chat/completions (tools, generation prompt or continued final message)."""

from __future__ import annotations

from typing import Any

from compiled_llm.engine.tokenizer_snapshot import json_value
from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from compiled_llm.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization(OpenAIServingChat):
    async def tokenize_request(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_fields(request, request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give either prompt or messages.")
        if request.messages is not None:
            if request.continue_final_message and request.add_generation_prompt \
                    and "add_generation_prompt" in request.model_fields_set:
                raise OpenAIError("Cannot set both `continue_final_message` and `add_generation_prompt` to true.")
            kwargs = dict(request.chat_template_kwargs or {})
            if request.tools:
                kwargs["tools"] = [t.model_dump(exclude_none=True) for t in request.tools]
            if request.continue_final_message:
                kwargs["continue_final_message"] = True
            _, ids = await self.render(request.messages, request.add_generation_prompt,
                                       request.chat_template, kwargs, bool(request.add_special_tokens))
        else:
            add_special_tokens = True if request.add_special_tokens is None else request.add_special_tokens
            ids = await self.tokenize(request.prompt or "", add_special_tokens)
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's GET /tokenizer_info: the tokenizer's configuration as its tokenizer_config.json
        states it (special tokens as their text, added tokens with their flags), its class, and the
        chat template this server renders with, so that a client can tokenize and render as the
        server does."""
        tokenizer = self.engine.tokenizer
        config = {key: json_value(value) for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if key not in ("vocab_file", "merges_file", "added_tokens_decoder")}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        config["added_tokens_decoder"] = {str(i): _added_token(token) for i, token in added.items()}
        config["tokenizer_class"] = getattr(tokenizer, "tokenizer_class", None) or type(tokenizer).__name__
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if template:
            config["chat_template"] = template
        return config

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_fields(request, request.model)
        vocab = self.engine.processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is out of vocabulary (vocabulary size {vocab}).", param="tokens")
        return DetokenizeResponse(prompt=await self.engine.detokenize(request.tokens))


def _added_token(token: Any) -> dict[str, Any]:
    """An added token as tokenizer_config.json writes it: its content and flags."""
    fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    return {name: getattr(token, name) for name in fields if hasattr(token, name)} if hasattr(token, "content") \
        else {"content": str(token), "special": False}
