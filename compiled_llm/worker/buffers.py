"""Host/device buffer pairs at fixed addresses, filled in place every step."""

from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    """A host tensor (with a numpy view for cheap vectorised writes) and its device twin.

    On a CPU the two are the same tensor, so `copy_to_device` is free.
    """

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device, fill: int = 0) -> None:
        on_gpu = device.type == "cuda"
        self.cpu = torch.full(shape, fill, dtype=dtype, pin_memory=on_gpu)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = self.cpu.to(device) if on_gpu else self.cpu

    def copy_to_device(self, n: int | None = None) -> torch.Tensor:
        if self.gpu is self.cpu:
            return self.cpu if n is None else self.cpu[:n]
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
