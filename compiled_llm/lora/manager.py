"""The model runner's LoRA manager: adapters kept on the host, loaded into slots as steps need them.

Up to `max_cpu_loras` adapters stay in host memory (least recently used dropped first, read again
from their folder if asked for later); at most `max_loras` sit in the model's slots, and every
step's adapters are placed into slots before its forward (`slots_for`). Every tensor-parallel rank
runs the same manager on the same steps, so the ranks agree on every slot without talking.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from compiled_llm.lora.peft_adapter import PEFTAdapter, load_peft_adapter
from compiled_llm.lora.request import LoRARequest
from compiled_llm.lora.slots import NO_SLOT, LoRASlots

if TYPE_CHECKING:
    from compiled_llm.models.layers.lora import LoRALinear


class LoRAManager:
    def __init__(self, layers: list[LoRALinear], scalings: torch.Tensor, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int) -> None:
        self.slots = LoRASlots(layers, scalings, max_loras)
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._requests: dict[int, LoRARequest] = {}  # every adapter a request has named, by id
        self._host: OrderedDict[int, PEFTAdapter] = OrderedDict()  # least recently used first

    def add_adapter(self, request: LoRARequest | None) -> int:
        """Remember the adapter a new request runs with (its weights are read when a step needs it);
        returns its id (0: none, the base model)."""
        if request is None:
            return 0
        known = self._requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:  # the id now names other weights
            self.remove_adapter(request.lora_int_id)
        self._requests[request.lora_int_id] = request
        return request.lora_int_id

    def remove_adapter(self, adapter_id: int) -> None:
        self.slots.remove(adapter_id)
        self._host.pop(adapter_id, None)
        self._requests.pop(adapter_id, None)

    def slots_for(self, adapter_ids: np.ndarray) -> np.ndarray:
        """The slot of each entry of `adapter_ids` (0: the base model, slot -1), placing the step's
        adapters into slots first."""
        wanted = {int(a) for a in np.unique(adapter_ids) if a > 0}
        slot_of = self.slots.activate(wanted, self._adapter)
        lookup = {0: NO_SLOT, **slot_of}
        return np.fromiter((lookup[int(a)] for a in adapter_ids), dtype=np.int64, count=len(adapter_ids))

    def _adapter(self, adapter_id: int) -> PEFTAdapter:
        adapter = self._host.get(adapter_id)
        if adapter is None:
            adapter = load_peft_adapter(self._requests[adapter_id].lora_path, self.max_lora_rank)
            self._host[adapter_id] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(adapter_id)
        return adapter
