"""`EngineArgs`: the user-facing engine settings (shared by `LLM`, `serve` and `precompile`),
their CLI flags, and their resolution into an `EngineConfig`."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields

from compiled_llm.compilation.config import CompilationConfig, CUDAGraphMode
from compiled_llm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, default_num_threads
from compiled_llm.utils import default_device


def _parse_ranges(text: str) -> list[tuple[int, int]]:
    """'1-64,65-2048' -> [(1, 64), (65, 2048)]"""
    ranges = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        ranges.append((int(lo), int(hi or lo)))
    return ranges


def _parse_sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


@dataclass
class EngineArgs:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    optimization_level: int | None = None
    compile_cache: str | None = None
    compile_ranges: list[tuple[int, int]] | None = None
    compile_sizes: list[int] = field(default_factory=list)
    require_cache_hit: bool = False
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: list[int] | None = None
    inductor_options: dict | None = None  # None: the device's defaults (CompilationConfig.resolve)
    cache_signing_key_file: str | None = None
    num_threads: int | None = None
    load_format: str = "auto"

    def create_engine_config(self) -> EngineConfig:
        device = default_device() if self.device is None else __import__("torch").device(self.device)
        model = self.model
        name = self.served_model_name
        if model is None:
            from compiled_llm.models.bundled import BUNDLED_MODEL_NAME, bundled_model_path

            model = str(bundled_model_path())
            name = name or BUNDLED_MODEL_NAME
        model_config = ModelConfig.from_folder(model, self.dtype, device, self.max_model_len, name, self.seed)
        on_gpu = device.type == "cuda"
        max_num_seqs = self.max_num_seqs or (256 if on_gpu else 128)
        max_num_batched_tokens = self.max_num_batched_tokens or max(8192 if on_gpu else 2048, max_num_seqs)
        scheduler_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, model_config.max_model_len)
        cache_config = CacheConfig(
            self.block_size, self.enable_prefix_caching, self.kv_cache_memory_bytes, self.gpu_memory_utilization
        )
        compilation_config = CompilationConfig(
            level=self.optimization_level,
            cache_dir=self.compile_cache,
            compile_ranges=self.compile_ranges,
            compile_sizes=list(self.compile_sizes),
            require_cache_hit=self.require_cache_hit,
            cudagraph_mode=CUDAGraphMode[self.cudagraph_mode.upper()] if self.cudagraph_mode else None,
            cudagraph_capture_sizes=self.cudagraph_capture_sizes,
            inductor_options=self.inductor_options,
            cache_signing_key_file=self.cache_signing_key_file,
        )
        compilation_config.resolve(device.type, max_num_seqs, max_num_batched_tokens)
        return EngineConfig(
            model_config,
            cache_config,
            scheduler_config,
            compilation_config,
            device=str(device),
            num_threads=self.num_threads or (default_num_threads() if device.type == "cpu" else None),
            extra={"load_format": self.load_format},
        )

    # ---- command line ---------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_model: bool = True) -> argparse.ArgumentParser:
        if with_model:
            parser.add_argument("model", nargs="?", default=None,
                                help="Hugging Face model folder (default: the bundled SmolLM2-135M-Instruct).")
        g = parser.add_argument_group("engine")
        g.add_argument("--served-model-name", default=None)
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available).")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--max-num-seqs", type=int, default=None)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        g.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores).")
        g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
        c = parser.add_argument_group("compilation")
        c.add_argument("-O", "--optimization-level", dest="optimization_level", type=int, default=None,
                       help="0 eager, 1 compiled pieces, 2 pieces + CUDA graphs (default: 1 on CPU, 2 on GPU).")
        c.add_argument("--compile-cache", default=None, help="Compile cache folder (default: under the user cache).")
        c.add_argument("--compile-ranges", type=_parse_ranges, default=None, help="e.g. 1-64,65-2048")
        c.add_argument("--compile-sizes", type=_parse_sizes, default=[], help="e.g. 1,2,4,8")
        c.add_argument("--require-cache-hit", action="store_true",
                       help="Fail instead of compiling when the compile cache misses.")
        c.add_argument("--cudagraph-mode", default=None, choices=[m.name.lower() for m in CUDAGraphMode])
        c.add_argument("--cudagraph-capture-sizes", type=_parse_sizes, default=None)
        c.add_argument("--inductor-options", type=json.loads, default=None,
                       help='Inductor config patches as JSON, e.g. \'{"cpp_wrapper": true}\' (default: tuned per device).')
        c.add_argument("--cache-signing-key-file", default=None,
                       help="File holding a secret key (16+ bytes): precompile signs the compile cache entry with it "
                            "and a start refuses an entry not signed with it, before loading any of it.")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})
