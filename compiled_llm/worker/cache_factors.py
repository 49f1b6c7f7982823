"""Which compile cache entry an engine's settings select: the engine's side of the cache key.

`compilation/` knows nothing of engines; this turns an `EngineConfig` and a tensor-parallel rank
into the plain values its `compute_factors` hashes, and builds the cache entry, signing key
included. No model is built (every source file of the package, the models' included, is
hashed), so `precompile --print-cache-key` answers at once.
"""

from __future__ import annotations

from typing import Any

from compiled_llm.compilation.cache_key import cache_key, compute_factors, package_sources
from compiled_llm.compilation.compile_cache import CompileCache, read_signing_key
from compiled_llm.config import EngineConfig
from compiled_llm.kernels.cpu_extension import uses_cpu_kernels
from compiled_llm.quantization import get_quantization_config


def engine_cache_factors(config: EngineConfig, rank: int, role: str | None = None) -> dict[str, Any]:
    """The factors of the entry tensor-parallel `rank` of an engine with these settings uses.
    `role`: "draft" for a speculative draft model (its own entry, even where it is the target's model)."""
    mc = config.model_config
    factors = compute_factors(
        hf_config=mc.hf_config,
        dtype=mc.dtype,
        device=config.torch_device,
        compilation_config=config.compilation_config,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        source_files=package_sources(),
        cpu_kernels=uses_cpu_kernels(config.torch_device, mc.dtype),  # what the model's layers call
        tensor_parallel=(rank, config.parallel_config.tensor_parallel_size),
    )
    quant_config = get_quantization_config(mc.quantization, mc)
    if quant_config is not None:  # the weight format: the method and its parameters (the graph calls its ops)
        factors["quantization"] = quant_config.cache_factors()
    if config.lora_config is not None and role is None:  # the slots' shapes; adapters are data, not code
        factors["lora"] = {"max_loras": config.lora_config.max_loras,
                           "max_lora_rank": config.lora_config.max_lora_rank,
                           "lora_dtype": config.lora_config.lora_dtype}
    if role is not None:
        factors["role"] = role
    return factors


def engine_compile_cache(config: EngineConfig, rank: int, role: str | None = None) -> CompileCache:
    """The compile cache entry `rank` reads and fills (a bad signing key file raises here)."""
    compilation = config.compilation_config
    factors = engine_cache_factors(config, rank, role)
    key_file = compilation.cache_signing_key_file
    signing_key = read_signing_key(key_file) if key_file else None
    about = {"model": config.model_config.model}  # shown by `cache list`; not a factor (weights are not)
    return CompileCache(compilation.cache_dir, cache_key(factors), factors, signing_key, about)


def start_reading_packed_weights(config: EngineConfig) -> None:
    """Start reading, in a thread, the packed weights a warm start of this engine on the CPU takes
    from its compile cache entry (models/loader.py: read_ahead_packed_weights), where its runs keep
    them there (compiled, weights from a checkpoint). Called as early as the settings are known:
    the offline `LLM` before its tokenizer and the engine's imports, the model runner again (a no-op
    where the read has begun); the runner drops bytes nobody took."""
    mc, cc = config.model_config, config.compilation_config
    if config.torch_device.type == "cpu" and cc.level and mc.load_format == "auto":
        from compiled_llm.models.loader import read_ahead_packed_weights

        read_ahead_packed_weights(mc, cc.cache_dir)
