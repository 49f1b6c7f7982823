"""How many KV-cache blocks fit: the memory budget (given, measured on a GPU, or a share of free
memory on a CPU) divided by the bytes one block takes in every layer."""

from __future__ import annotations

import math
import mmap

import psutil
import torch

from compiled_llm.config import CacheConfig, ModelConfig
from compiled_llm.logger import init_logger
from compiled_llm.utils import cdiv

logger = init_logger(__name__)

CPU_DEFAULT_KV_BYTES = 2 << 30
CUDA_GRAPH_RESERVE = 1 << 30  # captured graphs live outside the profiling run


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, num_kv_heads: int | None = None) -> int:
    """`num_kv_heads`: the heads this rank keeps (all of them without tensor parallelism)."""
    elem = torch.empty(0, dtype=model_config.dtype).element_size()
    heads = model_config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * block_size * heads * model_config.head_dim * elem * model_config.num_layers


def cpu_kv_budget(
    model_config: ModelConfig, block_size: int, max_num_reqs: int, num_kv_heads: int | None = None
) -> int:
    """Enough for every sequence at full length if memory allows, within 2 GiB and a fifth of what
    is free."""
    per_block = kv_bytes_per_block(model_config, block_size, num_kv_heads)
    wanted = per_block * (cdiv(model_config.max_model_len, block_size) * max_num_reqs + 1)
    return int(min(wanted, CPU_DEFAULT_KV_BYTES, psutil.virtual_memory().available // 5))


def gpu_kv_budget(cache_config: CacheConfig, peak_bytes: int, step_tokens: int, captures_graphs: bool) -> int:
    """`gpu_memory_utilization` of the GPU, less the profiled step's peak (weights included), what
    lives outside torch (the CUDA context, other processes) and the CUDA graphs."""
    free, total = torch.cuda.mem_get_info()
    outside_torch = total - free - torch.cuda.memory_reserved()
    graphs = CUDA_GRAPH_RESERVE if captures_graphs else 0
    budget = int(total * cache_config.gpu_memory_utilization - peak_bytes - outside_torch - graphs)
    logger.info(
        "GPU memory: %.2f GiB total, peak of a %d-token step %.2f GiB (weights included), %.2f GiB outside "
        "torch, %.2f GiB kept for CUDA graphs: %.2f GiB for the KV cache.",
        total / (1 << 30), step_tokens, peak_bytes / (1 << 30), outside_torch / (1 << 30), graphs / (1 << 30),
        budget / (1 << 30),
    )
    return budget


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache. On a CPU it is anonymous mmap memory, which the kernel zero-fills page by
    page on first touch: `torch.zeros` wrote all of it at start-up (2 GiB: 0.8-2.8 s on a 2-core
    machine) and the exit then freed every touched page (0.4 s)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, numel * torch.empty(0, dtype=dtype).element_size())
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor keeps the mapping


def num_blocks_for(budget: int, model_config: ModelConfig, block_size: int, num_kv_heads: int | None = None,
                   extra_bytes_per_block: int = 0) -> int:
    """Blocks in `budget` bytes; an error naming the fix when one full-length sequence won't fit.
    `extra_bytes_per_block`: what each block also takes elsewhere (a draft model's cache)."""
    per_block = kv_bytes_per_block(model_config, block_size, num_kv_heads) + extra_bytes_per_block
    max_blocks_per_req = cdiv(model_config.max_model_len, block_size)
    num_blocks = int(budget // per_block)
    if num_blocks - 1 < max_blocks_per_req:
        needed = (max_blocks_per_req + 1) * per_block
        raise ValueError(
            f"The KV cache ({budget} bytes, {max(num_blocks - 1, 0) * block_size} tokens) cannot hold one "
            f"sequence of max_model_len={model_config.max_model_len} tokens; give kv_cache_memory_bytes >= "
            f"{needed} or lower max_model_len."
        )
    return num_blocks
