"""POST /tokenize and /detokenize (vLLM's routes): the server's tokenizer, for clients that
count or cut tokens themselves."""

from __future__ import annotations

from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from compiled_llm.entrypoints.openai.serving_chat import OpenAIServingChat, message_dict


class OpenAIServingTokenization(OpenAIServingChat):
    async def tokenize_request(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give either prompt or messages.")
        if request.messages is not None:
            _, ids = await self.render([message_dict(m) for m in request.messages], request.add_generation_prompt)
        else:
            ids = await self.tokenize(request.prompt or "", request.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = self.engine.processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is out of the vocabulary (size {vocab}).", param="tokens")
        return DetokenizeResponse(prompt=await self.engine.detokenize(request.tokens))
