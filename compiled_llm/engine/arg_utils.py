"""`EngineArgs`: the user-facing engine settings (shared by `LLM`, `serve`, `precompile` and
`generate`), the command-line flags generated from them, and their resolution into the configs.

Each field's default is stated once: a setting that has one fixed default takes it from its
config class (`CacheConfig.block_size`); a setting whose default depends on the device or on
other settings is None here ("auto") and is resolved in `create_engine_config`, after which every
config holds concrete values only. The flags are generated from the fields (name, type, help),
as vLLM builds its own from its `EngineArgs`, so a new setting is one field. The same machinery
(`flag`, `setting`, `CliArgs`) builds the server's flags from `ServerArgs`
(entrypoints/openai/server_args.py).
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from compiled_llm.compilation.config import CompilationConfig, CUDAGraphMode
from compiled_llm.config import (
    CONVERTS,
    EXECUTOR_BACKENDS,
    GGUF,
    LORA_DTYPES,
    QUANTIZATION_NAMES,
    RUNNERS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_num_threads,
)
from compiled_llm.logger import init_logger
from compiled_llm.utils import default_device

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """'1-64,65-2048' -> [(1, 64), (65, 2048)]"""
    ranges = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        ranges.append((int(lo), int(hi or lo)))
    return ranges


def parse_sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def parse_pass_names(text: str) -> list[str]:
    """'rotary_attention,silu_mul_linear' -> the list; 'none' -> []"""
    names = [n.strip() for n in text.split(",") if n.strip()]
    return [] if names == ["none"] else names


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


# The help group of developer knobs (compiler internals, CUDA graphs, test weights): listed after
# every other group, so that `--help` shows what most users set first.
ADVANCED = "advanced"
_GROUP_DESCRIPTIONS = {ADVANCED: "Developer knobs: the defaults are what serving wants."}


def flag(help: str, *, group: str = "engine", short: str | None = None, choices: Any = None,
         parse: Callable[[str], Any] | None = None, metavar: str | None = None,
         nargs: str | None = None) -> dict[str, Any]:
    """A field's command-line flag: `--field-name` (and `short`), typed from its annotation unless
    `parse` says how (each value's, with `nargs`), in the help `group`."""
    return {"help": help, "group": group, "short": short, "choices": choices, "parse": parse, "metavar": metavar,
            "nargs": nargs}


def setting(default: Any, *args: Any, **kwargs: Any) -> Any:
    """A dataclass field with its default and its flag (the arguments of `flag`)."""
    return field(default=default, metadata=flag(*args, **kwargs))


def add_cli_args(parser: argparse.ArgumentParser, *settings: type) -> argparse.ArgumentParser:
    """One flag per field of each settings dataclass (`--max-num-seqs` for `max_num_seqs`), in help
    groups named by the fields' `group`, in the order the groups first appear, the advanced group
    last."""
    entries = [(f, typing.get_type_hints(cls)[f.name]) for cls in settings for f in fields(cls)]
    names = list(dict.fromkeys(f.metadata["group"] for f, _ in entries if not f.metadata.get("positional")))
    names.sort(key=lambda name: name == ADVANCED)
    groups = {name: parser.add_argument_group(name, _GROUP_DESCRIPTIONS.get(name)) for name in names}
    for f, hint in entries:
        if f.metadata.get("positional"):
            parser.add_argument(f.name, nargs="?", default=None, help=f.metadata["help"])
        else:
            _add_flag(groups[f.metadata["group"]], f, hint)
    return parser


def _add_flag(group: Any, f: Field[Any], hint: Any) -> None:
    meta = f.metadata
    names = [f"--{f.name.replace('_', '-')}"] + ([meta["short"]] if meta["short"] else [])
    default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta["help"]}
    if meta["metavar"]:
        kwargs["metavar"] = meta["metavar"]
    if meta.get("nargs"):
        kwargs["nargs"] = meta["nargs"]
    kind = _scalar_type(hint)
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = meta["parse"] or kind
        if meta["choices"] is not None:
            kwargs["choices"] = list(meta["choices"])
    group.add_argument(*names, **kwargs)


Args = TypeVar("Args", bound="CliArgs")


class CliArgs:
    """A settings dataclass whose fields are command-line flags (see `add_cli_args`)."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_cli_args(parser, cls)

    @classmethod
    def from_cli_args(cls: type[Args], args: argparse.Namespace) -> Args:
        """The fields' values from parsed flags (a Namespace may hold other classes' flags too)."""
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in vars(args).items() if k in names})


# `--quantization none`: the checkpoint's weights as they are, stated (the bundled model's float32
# conversion is then one flag away from its default, the shipped GGUF file).
NO_QUANTIZATION = "none"


@dataclass
class EngineArgs(CliArgs):
    model: str | None = field(default=None, metadata={"positional": True, "help": (
        "Hugging Face model folder or .gguf file (default: the bundled SmolLM2-135M-Instruct: on a CPU its "
        "shipped Q4_1 file, served as it ships; on a GPU, or with a --quantization that quantizes float "
        "weights, its float32 conversion).")})
    served_model_name: str | None = setting(None, "The model's name in the API (default: the folder's or file's "
                                                  "name).")
    dtype: str = setting("auto", "auto: on a CPU with AMX bf16; with avx512_bf16 but no AMX, bf16 weights "
                                 "under float32 activations (fp16_storage: faster there); else float32; on a "
                                 "GPU the checkpoint's. The choice and its reason are logged at start-up.",
                         choices=["auto", "float32", "bfloat16", "float16"])
    quantization: str | None = setting(
        None, "Weight format: int8 (per-channel) or int4 (group-wise) weight-only, quantized at load; "
        "fp16_storage (16-bit weights, float32 activations: chosen by itself for --dtype bfloat16/float16 on a "
        "CPU without native compute for it); gguf (a GGUF file's Q8_0/Q4_0/Q4_1 blocks served as they ship: "
        "chosen by itself for a .gguf MODEL); fp8 (e4m3 weights with per-channel scales, quantized at load; "
        "per-token activation scales and torch._scaled_mm on GPUs of compute capability >= 8.9, weight-only "
        "elsewhere). none: the checkpoint's weights as they are (with no MODEL: the bundled model's float32 "
        "conversion). Default: the checkpoint's weights as they are (with no MODEL on a CPU: gguf).",
        short="-q", choices=(*QUANTIZATION_NAMES, NO_QUANTIZATION))
    quantization_options: dict | None = setting(
        None, 'The method\'s options as JSON, e.g. \'{"group_size": 32}\' for int4 (32, 64 or 128; default 32).',
        parse=json.loads)
    device: str | None = setting(None, "cpu or cuda (default: cuda when available).")
    seed: int = setting(0, "Seed of the engine's random state.")
    max_model_len: int | None = setting(None, "Longest sequence, prompt and output (default: the model's).")
    max_logprobs: int = setting(ModelConfig.max_logprobs, "The most logprobs a request may ask for.")
    load_format: str = setting(ModelConfig.load_format, "auto: the folder's weights; dummy: random ones.",
                               group=ADVANCED, choices=["auto", "dummy"])
    max_num_seqs: int | None = setting(None, "Most requests in one step (default: 128 on a CPU, 256 on a GPU).")
    max_num_batched_tokens: int | None = setting(
        None, "Most tokens in one step (default: 2048 on a CPU, 8192 on a GPU).")
    scheduling_policy: str = setting(SchedulerConfig.policy, "fcfs: arrival order; priority: a request's "
                                     "`priority` (lower first), preempting lower ones.", choices=SCHEDULING_POLICIES)
    async_scheduling: bool | None = setting(
        None, "Schedule the next step while the device runs this one (default: on a GPU; a CPU gains nothing).",
        group=ADVANCED)
    speculative_config: dict | None = setting(
        None, 'Speculative decoding as JSON, vLLM\'s spelling: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (proposals from the request\'s own prompt and output) '
        'or \'{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}\' (a smaller model with the '
        'same tokenizer proposes); verified in one forward, exact for greedy and sampling. Runs with '
        'synchronous scheduling.',
        parse=json.loads)
    runner: str = setting("auto", "generate: sample tokens; pooling: one pooled vector per prompt (embeddings, "
                                  "/v1/embeddings, /pooling, /score, /rerank). auto: pooling when --convert embed, "
                                  "else generate.", choices=RUNNERS)
    convert: str = setting("auto", "How a decoder (*ForCausalLM) serves the pooling runner: embed (its final hidden "
                                   "states pooled, no lm_head). auto: embed under --runner pooling.", choices=CONVERTS)
    pooler_config: dict | None = setting(
        None, 'The pooling runner\'s pooler as JSON, vLLM\'s spelling: \'{"pooling_type": "MEAN", "normalize": true}\' '
        "(pooling_type LAST, MEAN or CLS; default LAST with normalize).", parse=json.loads)
    block_size: int = setting(CacheConfig.block_size, "Tokens per KV-cache block.")
    enable_prefix_caching: bool = setting(CacheConfig.enable_prefix_caching, "Reuse the KV cache of shared prefixes.")
    kv_cache_memory_bytes: int | None = setting(
        None, "KV-cache size (default: measured on a GPU, up to 2 GiB and a fifth of free memory on a CPU).")
    gpu_memory_utilization: float = setting(CacheConfig.gpu_memory_utilization,
                                            "Share of the GPU's memory this engine may use.")
    num_threads: int | None = setting(None, "CPU threads of each engine process (default: COMPILED_LLM_NUM_THREADS, "
                                            "else the cores this process may use, shared out over the ranks).")
    tensor_parallel_size: int = setting(ParallelConfig.tensor_parallel_size,
                                        "Ranks that split the model (one process each; gloo on CPUs, NCCL on GPUs).",
                                        group="parallel", short="-tp")
    data_parallel_size: int = setting(ParallelConfig.data_parallel_size,
                                      "Engines behind the server, each a full copy of the model.",
                                      group="parallel", short="-dp")
    distributed_executor_backend: str = setting(
        ParallelConfig.distributed_executor_backend, "mp: local processes; ray: Ray actors (placement groups, which "
        "may span the nodes of a Ray cluster).", group="parallel", choices=EXECUTOR_BACKENDS)
    optimization_level: int | None = setting(
        None, "0 eager, 1 compiled pieces, 2 pieces + CUDA graphs (default: 1 on a CPU, 2 on a GPU).",
        group="compilation", short="-O", choices=[0, 1, 2])
    compile_cache: str | None = setting(None, "Compile cache folder (default: under the user cache).",
                                        group="compilation", metavar="DIR")
    compile_ranges: list[tuple[int, int]] | None = setting(
        None, "Token-count ranges compiled symbolically, e.g. 1-64,65-2048 (default: one range to "
        "max_num_batched_tokens).", group="compilation", parse=parse_ranges)
    compile_sizes: list[int] = field(default_factory=list, metadata=flag(
        "Token counts compiled for their exact shape, e.g. 1,2,4,8.", group="compilation", parse=parse_sizes))
    require_cache_hit: bool = setting(False, "Fail instead of compiling when the compile cache misses.",
                                      group="compilation")
    cudagraph_mode: str | None = setting(None, "CUDA-graph mode (default: full_and_piecewise at -O2 on a GPU).",
                                         group=ADVANCED, choices=[m.name.lower() for m in CUDAGraphMode])
    cudagraph_capture_sizes: list[int] | None = setting(None, "Token counts captured as CUDA graphs.",
                                                        group=ADVANCED, parse=parse_sizes)
    inductor_options: dict | None = setting(
        None, 'Inductor config patches as JSON, e.g. \'{"cpp_wrapper": true}\' (default: tuned per device).',
        group=ADVANCED, parse=json.loads)
    compile_passes: list[str] | None = setting(
        None, "Compiler fusion passes, comma-separated, or 'none' (default: all, each fusing where its pattern "
        "occurs): rotary_attention (the rotary embedding inside the attention op's KV-cache write), "
        "silu_mul_linear (SwiGLU's gate inside the CPU down projection).", group=ADVANCED, parse=parse_pass_names)
    cache_signing_key_file: str | None = setting(
        None, "File holding a secret key (16+ bytes): precompile signs the compile cache entry with it and a "
        "start refuses an entry not signed with it, before loading any of it.", group="compilation")
    enable_lora: bool = setting(False, "Serve LoRA adapters (PEFT folders) on the base model, several in one batch.",
                                group="lora")
    max_loras: int = setting(LoRAConfig.max_loras, "Most distinct adapters in one step (the model's adapter slots).",
                             group="lora")
    max_lora_rank: int = setting(LoRAConfig.max_lora_rank, "Highest adapter rank served.", group="lora")
    max_cpu_loras: int | None = setting(None, "Adapters kept in host memory (default: max_loras).", group="lora")
    lora_dtype: str = setting(LoRAConfig.lora_dtype, "The adapters' dtype in their slots. auto: float16 where the C++ "
                              "CPU kernels apply them (float32 activations on a CPU: half the bytes to read), else the "
                              "activations' dtype.", group="lora", choices=list(LORA_DTYPES))

    def create_engine_config(self) -> EngineConfig:
        import torch

        device = default_device() if self.device is None else torch.device(self.device)
        speculative_config = (
            None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        )
        model, name = self.model, self.served_model_name
        if model is None:
            from compiled_llm.bundled_model import BUNDLED_MODEL_NAME, bundled_gguf_path, bundled_model_path

            model = str(bundled_gguf_path() if self._serves_bundled_file(device) else bundled_model_path())
            name = name or BUNDLED_MODEL_NAME
        model_config = ModelConfig.from_folder(
            model, self.dtype, device, self.max_model_len, name, self.seed, self.max_logprobs, self.load_format,
            self._quantization(), self.quantization_options,
        )
        model_config.runner, model_config.pooler_config = self._runner_and_pooler(model_config)
        pooling = model_config.runner == "pooling"
        if pooling and speculative_config is not None:
            raise ValueError("speculative_config: the pooling runner samples no tokens to speculate on.")
        if speculative_config is not None and speculative_config.method == "draft_model":
            speculative_config.draft_model_config = self._draft_model_config(speculative_config, model_config, device)
        default_seqs, default_tokens = SchedulerConfig.default_limits(device.type)
        max_num_seqs = self.max_num_seqs or default_seqs
        max_num_batched_tokens = self.max_num_batched_tokens or max(default_tokens, max_num_seqs)
        async_scheduling = device.type == "cuda" if self.async_scheduling is None else self.async_scheduling
        if pooling and async_scheduling:  # a pooling request ends with its prompt: no next token to overlap
            async_scheduling = False
        scheduler_config = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, model_config.max_model_len, self.scheduling_policy, async_scheduling
        )
        prefix_caching = self.enable_prefix_caching
        if pooling and prefix_caching and not model_config.pooler_config.supports_prefix_caching:
            logger.info("Prefix caching is off: %s pooling needs the hidden state of every prompt position.",
                        model_config.pooler_config.pooling_type)
            prefix_caching = False
        cache_config = CacheConfig(
            self.block_size, prefix_caching, self.kv_cache_memory_bytes, self.gpu_memory_utilization
        )
        compilation_config = CompilationConfig.resolve(
            device.type,
            max_num_seqs,
            max_num_batched_tokens,
            level=self.optimization_level,
            cache_dir=self.compile_cache,
            compile_ranges=self.compile_ranges,
            compile_sizes=self.compile_sizes,
            require_cache_hit=self.require_cache_hit,
            cudagraph_mode=CUDAGraphMode[self.cudagraph_mode.upper()] if self.cudagraph_mode else None,
            cudagraph_capture_sizes=self.cudagraph_capture_sizes,
            inductor_options=self.inductor_options,
            cache_signing_key_file=self.cache_signing_key_file,
            passes=self.compile_passes,
        )
        return EngineConfig(
            model_config,
            cache_config,
            scheduler_config,
            compilation_config,
            device=str(device),
            num_threads=self.num_threads or (self._cpu_threads_per_rank() if device.type == "cpu" else None),
            parallel_config=ParallelConfig(
                self.tensor_parallel_size, self.data_parallel_size, self.distributed_executor_backend
            ),
            speculative_config=speculative_config,
            lora_config=(LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)
                         if self.enable_lora else None),
        )

    def _draft_model_config(self, spec: SpeculativeConfig, target: ModelConfig, device: torch.device) -> ModelConfig:
        """The draft model's config: the target's dtype setting, length and load format (random
        weights for both under `dummy`, the same ones where the draft is the target's folder), its
        own weight format; it must share the target's vocabulary (its proposals are the target's
        token ids)."""
        assert spec.model is not None
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative_config: method draft_model runs with tensor_parallel_size 1 only.")
        draft = ModelConfig.from_folder(spec.model, self.dtype, device, target.max_model_len, seed=self.seed,
                                        load_format=self.load_format, quantization=spec.quantization)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model {spec.model} has a vocabulary of {draft.vocab_size} "
                             f"tokens, the target {target.vocab_size}: a draft must share the target's tokenizer.")
        return draft

    def _runner_and_pooler(self, model_config: ModelConfig) -> tuple[str, PoolerConfig | None]:
        """The runner and, for pooling, its pooler. The decoders served here have no pooler or
        classification head of their own: pooling serves them converted to embedders (vLLM's
        `--convert embed`), the final hidden states pooled."""
        convert = self.convert
        runner = self.runner
        if runner == "auto":
            runner = "pooling" if convert in ("embed", "classify") else "generate"
        if convert == "classify":
            raise ValueError(f"--convert classify needs a classification head, which {model_config.architecture} "
                             "checkpoints do not have; use --convert embed.")
        if runner == "generate":
            if convert == "embed":
                raise ValueError("--convert embed serves the pooling runner: use --runner pooling (or leave it auto).")
            if self.pooler_config is not None:
                raise ValueError("--pooler-config configures the pooling runner: add --runner pooling.")
            return runner, None
        if convert == "none":
            raise ValueError(f"{model_config.architecture} has no pooler of its own: serve it with --runner pooling "
                             "--convert embed.")
        return runner, PoolerConfig.from_dict(self.pooler_config)

    def _serves_bundled_file(self, device: torch.device) -> bool:
        """Whether the bundled model is served from its shipped GGUF file rather than its float32
        conversion: on a CPU, where the file's Q4_1 blocks decode faster than float32 weights and
        start without a conversion (the same weights: Q4_1 de-quantizes exactly), unless another
        method is asked for; on a GPU only when asked (the GGUF kernels there are Triton's)."""
        if self.quantization is not None:
            return self.quantization == GGUF
        return device.type == "cpu"

    def _quantization(self) -> str | None:
        return None if self.quantization == NO_QUANTIZATION else self.quantization

    def _cpu_threads_per_rank(self) -> int:
        """The machine's threads shared out over every rank of every engine."""
        return max(1, default_num_threads() // (self.tensor_parallel_size * self.data_parallel_size))


def _scalar_type(hint: Any) -> Any:
    """`int | None` -> int; `bool` -> bool; anything else (lists, dicts) -> str (a `parse` reads it)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = options[0] if len(options) == 1 else hint
    base = hint
    return base if base in (bool, int, float, str) else str
