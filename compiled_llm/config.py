"""Engine configuration: one small dataclass per concern, gathered in `EngineConfig`.

`EngineArgs` (engine/arg_utils.py) turns user flags into these; everything below the
entrypoints reads only these.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compiled_llm.compilation.config import CompilationConfig
from compiled_llm.config_json import read_config
from compiled_llm.gguf_file import is_gguf, metadata_folder
from compiled_llm.utils import cpu_flags

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def cpu_native_bf16() -> str | None:
    """The CPU feature that runs bf16 matmuls natively (AMX or avx512_bf16), or None: without one,
    bf16 matmuls are emulated and about 100x slower than float32."""
    flags = cpu_flags()
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


# What `--dtype auto` means on a CPU when set (float32 or bfloat16), instead of the choice by the
# CPU's flags: the test suite pins float32, so that its KV budgets (sized in bytes) and its exact
# comparisons mean the same on every CPU.
AUTO_CPU_DTYPE_ENV = "COMPILED_LLM_CPU_AUTO_DTYPE"


def auto_cpu_dtype() -> torch.dtype:
    """bfloat16 where the CPU has native bf16, float32 elsewhere, unless `AUTO_CPU_DTYPE_ENV` says."""
    forced = os.environ.get(AUTO_CPU_DTYPE_ENV)
    if forced:
        if _DTYPES.get(forced) not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{AUTO_CPU_DTYPE_ENV}={forced!r}: use float32 or bfloat16.")
        return _DTYPES[forced]
    return torch.bfloat16 if cpu_native_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device: torch.device) -> torch.dtype:
    """`auto` on a CPU: bfloat16 where the CPU has native bf16 (AMX or avx512_bf16), float32
    elsewhere. On a GPU: the checkpoint's half-precision dtype, and bfloat16 for a float32
    checkpoint (as vLLM does)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"Unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16.")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return auto_cpu_dtype()
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = _DTYPES.get(checkpoint)
    if checkpoint in (None, torch.float32):
        return torch.bfloat16
    return checkpoint


def describe_cpu_dtype(dtype: torch.dtype) -> str:
    """Why a CPU engine runs in `dtype`, for the start-up log (what `auto` would pick, and why)."""
    native = cpu_native_bf16()
    name = str(dtype).removeprefix("torch.")
    forced = os.environ.get(AUTO_CPU_DTYPE_ENV)
    if forced and dtype == auto_cpu_dtype():
        by_flags = "bfloat16" if native else "float32"
        return f"{name}: {AUTO_CPU_DTYPE_ENV}={forced} (by its flags the CPU would get {by_flags})"
    if dtype == torch.bfloat16:
        return (f"{name}: the CPU has {native}" if native else
                f"{name} as asked, but the CPU has no native bf16 (neither AMX nor avx512_bf16): matmuls run "
                "about 100x slower than in float32")
    if dtype != torch.float32 or native:
        return f"{name} as asked (auto would pick " + (f"bfloat16: the CPU has {native}" if native else "float32") + ")"
    return f"{name}: the CPU has no native bf16 (neither AMX nor avx512_bf16), where bf16 matmuls are ~100x slower"


# The prefixes the Prometheus metrics' names may take (`serve --metrics-namespace`): our own, or vLLM's
# for dashboards and alerts made for vLLM. The first is the default.
METRICS_NAMESPACES = ("compiled_llm", "vllm")

# The weight formats of `--quantization` (compiled_llm/quantization/ holds one file per method).
QUANTIZATION_NAMES = ("int8", "int4", "fp16_storage", "gguf", "fp8")
# The method of a .gguf MODEL (and of no other): its blocks served as they ship.
GGUF = "gguf"
# The methods whose CPU GEMM takes float32 activations: `--dtype auto` means float32 for them.
FLOAT32_ACTIVATION_METHODS = ("gguf", "int8", "int4")
# The 16-bit weight storage method: float32 activations over 16-bit weights.
HALF_STORAGE = "fp16_storage"


def resolve_quantization(
    quantization: str | None, options: dict[str, Any] | None, dtype: torch.dtype, device: torch.device,
    auto_dtype: bool = False,
) -> tuple[str | None, dict[str, Any], torch.dtype]:
    """(method, its options, the activations' dtype). A 16-bit dtype on a CPU that cannot compute
    in it natively (bf16 without AMX or avx512_bf16; fp16 on any CPU) becomes 16-bit weight storage
    with float32 activations, unless another method is asked for: such matmuls are ~100x slower
    than float32, while storage alone halves the bytes a decode step reads."""
    options = dict(options or {})
    if quantization is not None and quantization not in QUANTIZATION_NAMES:
        raise ValueError(f"Unknown quantization method {quantization!r}; known: {', '.join(QUANTIZATION_NAMES)}.")
    half = dtype in (torch.float16, torch.bfloat16)
    emulated = device.type == "cpu" and (dtype == torch.float16 or (dtype == torch.bfloat16 and not cpu_native_bf16()))
    # `auto` picked bf16 on a CPU whose native bf16 is avx512_bf16 without AMX: there our bf16 matmuls
    # decode at 0.6x float32 (28 against 47 tok/s at batch 1 on a Zen 5), while bf16 storage under
    # float32 activations decodes at 1.7x and is faster at 32 requests too: store, do not compute.
    emulated = emulated or (auto_dtype and device.type == "cpu" and dtype == torch.bfloat16
                            and cpu_native_bf16() != "amx_bf16")
    if quantization == HALF_STORAGE or (quantization is None and half and emulated):
        if not half:
            raise ValueError(f"{HALF_STORAGE} stores the weights in --dtype bfloat16 or float16, not {dtype}.")
        return HALF_STORAGE, {"dtype": str(dtype).removeprefix("torch.")}, torch.float32
    return quantization, options, dtype


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """Read `rope_theta` and the scaling dict under both transformers 4 and 5 spellings.

    transformers 5 nests `rope_theta` inside `rope_parameters`; a silent fallback to a default
    theta would corrupt every output, so a missing theta is an error.
    """
    params = getattr(hf_config, "rope_parameters", None)
    theta = getattr(hf_config, "rope_theta", None)
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = params
    if theta is None:
        raise ValueError("The model config has no rope_theta (neither top-level nor in rope_parameters).")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind in (None, "default") else dict(scaling, rope_type=kind)
    return float(theta), scaling


POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")


@dataclass
class PoolerConfig:
    """How a pooling runner turns a prompt's hidden states into one vector (vLLM's PoolerConfig,
    `--pooler-config` JSON). An embed-converted decoder defaults to LAST and normalize: its last
    token is the only one that has attended to the whole prompt."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.pooling_type = str(self.pooling_type).upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config: unknown pooling_type {self.pooling_type!r}; known: "
                             f"{', '.join(POOLING_TYPES)}.")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config: normalize must be true or false, got {self.normalize!r}.")

    @property
    def supports_prefix_caching(self) -> bool:
        """Only LAST: a cached block's positions are not computed again, so their hidden states
        (every one for MEAN, the first for CLS) would be missing; the last token never is cached."""
        return self.pooling_type == "LAST"

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | PoolerConfig | None) -> PoolerConfig:
        if spec is None or isinstance(spec, PoolerConfig):
            return spec or cls()
        if not isinstance(spec, dict):
            raise ValueError(f"pooler_config must be a JSON object (a dict), got {type(spec).__name__}.")
        unknown = sorted(set(spec) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler_config: unknown field(s) {', '.join(unknown)}; known: normalize, pooling_type.")
        return cls(**spec)


@dataclass
class ModelConfig:
    model: str  # a local Hugging Face folder, or a .gguf file
    # The folder the config, tokenizer and chat template are read from: the model folder, or a GGUF
    # file's metadata folder (gguf_file.py).
    tokenizer: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: list[int]
    served_model_name: str
    seed: int = 0
    max_logprobs: int = 20  # the most logprobs (and top_logprobs) a request may ask for
    load_format: str = "auto"  # "auto": the folder's safetensors; "dummy": random weights (no checkpoint)
    quantization: str | None = None  # the weight format (QUANTIZATION_NAMES), None: as the checkpoint has it
    quantization_options: dict[str, Any] = field(default_factory=dict)  # e.g. int4's {"group_size": 32}
    runner: str = "generate"  # "generate": sample tokens; "pooling": one pooled vector per prompt
    pooler_config: PoolerConfig | None = None  # the pooling runner's (None when generating)

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.hf_config, "head_dim", None) or self.hf_config.hidden_size // self.num_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @classmethod
    def from_folder(
        cls,
        model: str,
        dtype: str | torch.dtype,
        device: torch.device,
        max_model_len: int | None = None,
        served_model_name: str | None = None,
        seed: int = 0,
        max_logprobs: int = 20,
        load_format: str = "auto",
        quantization: str | None = None,
        quantization_options: dict[str, Any] | None = None,
    ) -> "ModelConfig":
        path = Path(model)
        if is_gguf(path):  # config and tokenizer from the file's metadata, read once into a folder
            if quantization not in (None, GGUF):
                raise ValueError(f"{model} is a GGUF file, served by quantization method {GGUF!r}, not "
                                 f"{quantization!r}.")
            quantization, folder = GGUF, metadata_folder(path)
        else:
            if quantization == GGUF:
                raise ValueError(f"Quantization method {GGUF!r} serves a .gguf MODEL file; {model!r} is not one.")
            folder = path
            if not folder.is_dir():
                raise FileNotFoundError(
                    f"Model folder {model!r} does not exist. compiled-llm loads local Hugging Face folders "
                    "(config.json, *.safetensors, tokenizer files) or .gguf files; nothing is fetched from a hub."
                )
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(f"{folder} has no config.json; it is not a Hugging Face model folder.")
        hf_config = read_config(folder)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Unsupported architecture {archs[0] if archs else None!r} in {folder}/config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        rope_parameters(hf_config)  # fail early on a config without rope_theta
        layer_types = getattr(hf_config, "layer_types", None) or []
        if getattr(hf_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"{folder}/config.json asks for sliding-window attention, which this engine does not "
                "implement (it would silently attend to the whole context)."
            )
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings ({limit})."
            )
        if quantization in FLOAT32_ACTIVATION_METHODS and dtype == "auto" and device.type == "cpu":
            # The CPU kernels de-quantize against float32 activations: `auto` must not pick bf16
            # there (it would leave them for a de-quantize of the whole weight every step).
            dtype = torch.float32
        quantization, quantization_options, activation_dtype = resolve_quantization(
            quantization, quantization_options, resolve_dtype(dtype, hf_config, device), device,
            dtype == "auto" and not os.environ.get(AUTO_CPU_DTYPE_ENV))
        return cls(
            model=str(path),
            tokenizer=str(folder),
            hf_config=hf_config,
            dtype=activation_dtype,
            max_model_len=int(max_model_len),
            eos_token_ids=_eos_token_ids(folder, hf_config),
            served_model_name=served_model_name or (path.stem if is_gguf(path) else path.name),
            seed=seed,
            max_logprobs=max_logprobs,
            load_format=load_format,
            quantization=quantization,
            quantization_options=quantization_options,
        )


def _eos_token_ids(folder: Path, hf_config: Any) -> list[int]:
    """EOS ids from generation_config.json, falling back to config.json."""
    eos: Any = None
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # None: measured (GPU) or a share of free memory (CPU)
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # "fcfs": arrival order. "priority": lower `priority` first (then arrival); when the KV cache
    # runs out, the lowest-priority running request is preempted.
    policy: str = "fcfs"
    # Schedule step N+1 while the device runs step N; sampled tokens reach the host a step late.
    async_scheduling: bool = False

    @staticmethod
    def default_limits(device_type: str) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) when not given: bigger batches on a GPU."""
        return (256, 8192) if device_type == "cuda" else (128, 2048)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running request needs a token per step."
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"Unknown scheduling policy {self.policy!r}; use one of {', '.join(SCHEDULING_POLICIES)}.")


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass
class ParallelConfig:
    """How one model is spread: `tensor_parallel_size` ranks per engine (one process each, the
    first in the engine core's process), `data_parallel_size` engines behind one server, placed as
    local processes (`mp`) or Ray actors (`ray`)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError("tensor_parallel_size and data_parallel_size must be at least 1.")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"Unknown distributed executor backend {self.distributed_executor_backend!r}; "
                f"use one of {', '.join(EXECUTOR_BACKENDS)}."
            )
        if self.distributed_executor_backend == "ray" and self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 with tensor_parallel_size > 1 is not supported on the ray backend "
                "(each Ray data-parallel engine holds one rank); use the mp backend, or one of the two."
            )


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, in vLLM's spelling (`--speculative-config` JSON, `LLM(speculative_config=...)`).

    `ngram` (prompt lookup): the next `num_speculative_tokens` tokens are proposed from the request's
    own prompt and output, following the latest earlier occurrence of its last n tokens (n from
    `prompt_lookup_max` down to `prompt_lookup_min`), then verified in one forward. Nothing here
    changes the compiled graph (a verification is more query tokens, like a prompt chunk), so it is
    not part of the compile-cache key.

    `draft_model`: a smaller `model` (a folder or .gguf file) with the target's vocabulary proposes
    them, greedily, from its own paged KV cache (worker/draft_proposer.py); it is compiled into its
    own compile-cache entry. `draft_model_config` is resolved from `model` by the engine's arguments.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # No drafts in a step where more requests than this are running: at large batches a decode step
    # is no longer bound by reading the weights, and verifying guesses costs compute (None: always).
    disable_by_batch_size: int | None = None
    # Measure, per batch size, whether steps with drafts yield more tokens per second than steps
    # without, and speculate only where they do (spec_decode/gain.py). Off by default: on a short
    # batch-1 workload its learning and probes cost more than they saved (72-80 against 89-92 tok/s).
    measure_gain: bool = False
    model: str | None = None  # draft_model: the draft's folder or .gguf file
    quantization: str | None = None  # draft_model: the draft's weight format (None: as its checkpoint has it)
    draft_model_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; known: "
                             f"{', '.join(SPECULATIVE_METHODS)}.")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method draft_model needs model (the draft's folder or .gguf file).")
        if self.method != "draft_model" and (self.model is not None or self.quantization is not None):
            raise ValueError(f"speculative_config: model and quantization are draft_model's fields, not "
                             f"{self.method}'s.")
        if not isinstance(self.measure_gain, bool):
            raise ValueError(f"speculative_config: measure_gain must be true or false, got {self.measure_gain!r}.")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}.")
        if self.method != "ngram":
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError(f"speculative_config: prompt_lookup_min/max are ngram's fields, not {self.method}'s.")
            return
        # vLLM's defaults: one bound gives the other; neither gives 5 and 5.
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max}).")

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the user's dict (or JSON object); an unknown key or a missing
        `num_speculative_tokens` is an error naming it."""
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(spec).__name__}.")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                 "model", "quantization", "measure_gain"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}.")
        if "method" not in spec and spec.get("model"):  # vLLM: a model alone means a draft model
            spec = {**spec, "method": "draft_model"}
        if "method" not in spec:
            raise ValueError("speculative_config: method is required (e.g. \"ngram\").")
        if spec.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config: num_speculative_tokens is required (an integer >= 1).")
        return cls(**spec)


LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass
class LoRAConfig:
    """LoRA adapters (`enable_lora`): `max_loras` adapters in one step (the model's preallocated
    slots), each of rank up to `max_lora_rank`; `max_cpu_loras` kept in host memory. The slots'
    shapes and dtype are in the compiled graph (and the compile-cache key); the adapters are data.
    `lora_dtype`: the slots' dtype. "auto" is float16 where the C++ CPU kernels apply the adapters
    (float32 activations on a CPU: at batch 32 with eight adapters a step reads every adapter's
    matrices once a layer, and half the bytes is most of the adapters' cost), else the
    activations' dtype (vLLM's "auto")."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}.")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    compilation_config: CompilationConfig
    device: str = "cpu"
    num_threads: int | None = None  # CPU threads of each rank's process; None on a GPU
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # None: LoRA off (`enable_lora`)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def default_num_threads() -> int:
    """COMPILED_LLM_NUM_THREADS, else every core this process may run on (its CPU affinity: a
    container's or taskset's limit, not the machine's core count)."""
    configured = int(os.environ.get("COMPILED_LLM_NUM_THREADS", 0))
    if configured:
        return configured
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
