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
from compiled_llm.entrypoints.openai.serving_chat import message_dict
from compiled_llm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give either prompt or messages.")
        if request.messages is not None:
            try:
                _, ids = await self.engine.apply_chat_template(
                    [message_dict(m) for m in request.messages], request.add_generation_prompt
                )
            except OpenAIError:
                raise
            except Exception as e:
                raise OpenAIError(f"Could not apply the chat template: {e}", param="messages") from e
        else:
            ids = await self.engine.tokenize(request.prompt or "", request.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = self.engine.processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is out of the vocabulary (size {vocab}).", param="tokens")
        return DetokenizeResponse(prompt=await self.engine.detokenize(request.tokens))
