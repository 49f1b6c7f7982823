"""The names a request's `model` may give: the base model's and its LoRA adapters' (vLLM's
`--lora-modules`, and `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` at run time).

An adapter is data for the engine (a folder it reads into a slot when a batch needs it), so naming
one here only maps a request to its `LoRARequest`; the engine's frontend reads and checks the
adapter before a request that names it is queued, and again here when it is loaded at run time,
so a bad one is a 400 and never reaches the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.lora_modules import LoRAModulePath
from compiled_llm.entrypoints.openai.protocol import ModelCard
from compiled_llm.lora.request import LoRARequest

if TYPE_CHECKING:
    from compiled_llm.engine.async_llm import AsyncLLM

class ServedModels:
    """The base model and the adapters a request may name, shared by every API of one server."""

    def __init__(self, engine: AsyncLLM, base_name: str, lora_modules: list[LoRAModulePath] = ()) -> None:
        self.engine = engine
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self._next_id = 1
        if lora_modules and engine.processor.lora_config is None:
            raise ValueError("--lora-modules needs --enable-lora (the engine builds its adapter slots then).")
        for module in lora_modules:
            self.add(module.name, module.path, module.base_model_name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register an adapter after reading and checking it (ValueError naming the problem)."""
        if name == self.base_name or name in self.adapters:
            raise ValueError(f"The model name {name!r} is taken: unload it first, or choose another name.")
        request = LoRARequest(name, self._next_id, path)
        self.engine.processor.check_lora(request)
        self._next_id += 1
        self.adapters[name] = request
        self.parents[name] = base_model_name or self.base_name
        return request

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise OpenAIError(f"The LoRA adapter `{name}` is not loaded.", 404, "lora_name", "model_not_found")
        del self.adapters[name]
        del self.parents[name]

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); a 404 for a name nobody serves."""
        if model is None or model == self.base_name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        names = ", ".join(f"`{n}`" for n in [self.base_name, *self.adapters])
        raise OpenAIError(f"The model `{model}` does not exist; this server serves {names}.", 404, "model",
                          "model_not_found")

    def cards(self) -> list[ModelCard]:
        config = self.engine.model_config
        base = ModelCard(id=self.base_name, root=config.model, max_model_len=config.max_model_len)
        return [base] + [ModelCard(id=name, root=request.lora_path, parent=self.parents[name],
                                   max_model_len=config.max_model_len)
                         for name, request in self.adapters.items()]

    def card(self, model: str) -> ModelCard:
        self.lora_request(model)  # a 404 for an unknown name
        return next(card for card in self.cards() if card.id == model)
