"""The model runner's LoRA manager: adapters kept on the host, loaded into slots as steps need them.

Up to `max_cpu_loras` adapters stay in host memory (least recently used dropped first, read again
from their folder if asked for later); at most `max_loras` sit in the model's slots, and every
step's adapters are placed into slots before its forward (`slots_for`). Every tensor-parallel rank
runs the same manager on the same steps, so the ranks agree on every slot without talking.

The engine core pins (`pin`) the adapter of every request it accepts before the request can be
scheduled: the adapter is read and checked then, and stays in host memory while a request names
it (`max_cpu_loras` bounds only the unpinned ones). A step therefore never reads a folder, and a
folder that vanished or changed after the frontend checked it fails its own request, not the step
and with it the engine.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from compiled_llm.lora.peft_adapter import LoRAAdapterError, PEFTAdapter, check_fits, load_peft_adapter
from compiled_llm.lora.request import LoRARequest
from compiled_llm.lora.slots import NO_SLOT, LoRASlots

if TYPE_CHECKING:
    from compiled_llm.models.layers.lora import LoRALinear


class LoRAManager:
    def __init__(self, layers: list[LoRALinear], scalings: torch.Tensor, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, hf_config: object) -> None:
        self.slots = LoRASlots(layers, scalings, max_loras)
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.hf_config = hf_config  # the shapes a pinned adapter is checked against
        self._paths: dict[int, str] = {}  # every adapter a request has named: its folder, by id
        self._host: OrderedDict[int, PEFTAdapter] = OrderedDict()  # least recently used first
        self._pinned: set[int] = set()  # adapters the engine's unfinished requests name (kept in host memory)

    def add_adapter(self, request: LoRARequest | None) -> int:
        """Remember the adapter a new request runs with (its weights are read when a step needs it);
        returns its id (0: none, the base model)."""
        if request is None:
            return 0
        self._name(request.lora_int_id, request.lora_path)
        return request.lora_int_id

    def pin(self, adapter_id: int, path: str) -> str | None:
        """Read and check the adapter now (unless it is in host memory) and keep it there until
        `unpin`; returns why it cannot be served (None: it can). The error is returned, not
        raised, so that every tensor-parallel rank answers the call."""
        self._name(adapter_id, path)
        try:
            adapter = self._adapter(adapter_id)
            check_fits(adapter, self.hf_config)
        except LoRAAdapterError as e:
            self._forget(adapter_id)
            return str(e)
        self._pinned.add(adapter_id)
        return None

    def unpin(self, adapter_id: int) -> None:
        self._pinned.discard(adapter_id)
        self._evict()

    def remove_adapter(self, adapter_id: int) -> None:
        self._pinned.discard(adapter_id)
        self._forget(adapter_id)

    def _name(self, adapter_id: int, path: str) -> None:
        if self._paths.get(adapter_id, path) != path:  # the id now names other weights
            self.remove_adapter(adapter_id)
        self._paths[adapter_id] = path

    def _forget(self, adapter_id: int) -> None:
        self.slots.remove(adapter_id)
        self._host.pop(adapter_id, None)
        self._paths.pop(adapter_id, None)

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
            adapter = load_peft_adapter(self._paths[adapter_id], self.max_lora_rank)
            self._host[adapter_id] = adapter
        self._host.move_to_end(adapter_id)
        self._evict()
        return adapter

    def _evict(self) -> None:
        """Drop the least recently used unpinned adapters past `max_cpu_loras` (pinned ones stay)."""
        unpinned = [a for a in self._host if a not in self._pinned]
        for adapter_id in unpinned[: max(0, len(self._host) - self.max_cpu_loras)]:
            del self._host[adapter_id]
