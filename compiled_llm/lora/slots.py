"""Adapter slots: the preallocated A/B stacks of every LoRA layer, and which adapter each slot holds.

A slot is an index into the stacks (`[max_loras, ...]` in every layer) and into the per-slot
scalings; a token's slot index selects its adapter, -1 none (the base model). Loading an adapter
writes its matrices into a slot in place, so the model's tensors never change shape or address.
Slots are reused least recently used first, never one that the step being prepared needs.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import torch

from compiled_llm.lora.peft_adapter import LoRAAdapterError, PEFTAdapter

if TYPE_CHECKING:
    from compiled_llm.models.layers.lora import LoRALinear

NO_SLOT = -1


class LoRASlots:
    def __init__(self, layers: list[LoRALinear], scalings: torch.Tensor, max_loras: int) -> None:
        self.layers = layers
        self.scalings = scalings
        self.max_loras = max_loras
        self._lru: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._targets = {(layer.layer, module) for layer in layers for module in layer.modules}
        self.num_loads = 0  # adapters written into a slot (tests count them)

    def slot_of(self, adapter_id: int) -> int | None:
        return self._lru.get(adapter_id)

    @property
    def loaded(self) -> list[int]:
        return list(self._lru)

    def activate(self, adapter_ids: set[int], adapter: Callable[[int], PEFTAdapter]) -> dict[int, int]:
        """A slot for each of a step's adapters (at most `max_loras`), writing those not loaded
        (`adapter(id)` gives their weights) into free slots or the least recently used ones that
        this step does not need."""
        if len(adapter_ids) > self.max_loras:
            raise RuntimeError(f"a step needs {len(adapter_ids)} adapters, max_loras is {self.max_loras}")
        for adapter_id in adapter_ids & self._lru.keys():
            self._lru.move_to_end(adapter_id)
        for adapter_id in sorted(adapter_ids - self._lru.keys()):
            self._write(self._free_slot(adapter_ids), adapter_id, adapter(adapter_id))
        return {adapter_id: self._lru[adapter_id] for adapter_id in adapter_ids}

    def remove(self, adapter_id: int) -> None:
        slot = self._lru.pop(adapter_id, None)
        if slot is not None:
            self._clear(slot)

    def _free_slot(self, keep: set[int]) -> int:
        used = set(self._lru.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(a for a in self._lru if a not in keep)
        return self._lru.pop(victim)

    def _write(self, slot: int, adapter_id: int, adapter: PEFTAdapter) -> None:
        extra = sorted(set(adapter.weights) - self._targets)
        if extra:
            raise LoRAAdapterError(f"LoRA adapter {adapter.path}: weights for {extra[:3]} match no layer of the model.")
        try:
            for layer in self.layers:
                layer.set_slot(slot, {m: adapter.weights[(layer.layer, m)] for m in layer.modules
                                      if (layer.layer, m) in adapter.weights})
        except ValueError as e:
            self._clear(slot)
            raise LoRAAdapterError(f"LoRA adapter {adapter.path}: {e}") from None
        self.scalings[slot] = adapter.scaling
        self._lru[adapter_id] = slot
        self.num_loads += 1

    def _clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear_slot(slot)
        self.scalings[slot] = 0.0
