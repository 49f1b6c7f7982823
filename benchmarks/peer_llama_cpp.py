"""llama.cpp, the peer of the CPU benchmarks for one stream (weight_formats.py, perplexity.py).

llama.cpp comes through llama-cpp-python built from source for this CPU (benchmarks/
setup_llama_cpp.sh makes the venv, benchmarks/.llama-venv or $LLAMA_VENV, and the GGUF files). It
lives apart from our environment, so this module has two roles, as peer_vllm.py has:

- Imported by the benchmarks (our environment; standard library only): `LlamaCppPeer` starts the
  venv's python on this file as a long-lived worker that loads one GGUF file, and sends it jobs one
  JSON line at a time, so that its measurements can interleave with ours run by run (a shared VM's
  speed drifts within minutes: interleaving keeps each ratio's two sides in the same minute).
- Run as a script by the venv's python: it answers each job with one line `PEER_RESULT {json}`.

Everything runs through llama.cpp's C API (the low-level bindings), the way its own server
drives it, so every engine is fed the same token ids and no tokenizer or sampler of
llama-cpp-python's Python layer is timed:
- batch-1 decode and time to first token: one sequence, its prompt in one batch, then one token a
  `llama_decode`; greedy is an argmax over the logits (numpy) as ours is over its own.
- 32 requests: continuous batching as llama-server does it (one context with a unified KV cache
  and a sequence id per request; each `llama_decode` carries one token for every sequence that is
  generating plus as many prompt tokens of waiting sequences as fit in n_batch).
- perplexity: windows of token ids, each decoded in one batch with logits at every position.
Context settings are llama.cpp's defaults (n_batch 2048, n_ubatch 512, flash attention `auto`)
except n_ctx, n_seq_max, kv_unified and the thread counts, which the job gives.

Prompt-lookup decoding (spec_decode.py) lives only in llama-cpp-python's Python layer, so
`LlamaCppLookupPeer` drives it there: `Llama.generate`, the token generator under
`create_completion(stream=True)`, with and without `draft_model=LlamaPromptLookupDecoding(...)`, fed
our prompt ids; greedy, no detokenization and no stop at EOS (generate does not stop there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION = "0.3.36"
RESULT_TAG = "PEER_RESULT "
# "1": the worker loads models with llama.cpp's extra buffer types off (see repacking_crashes).
NO_EXTRA_BUFTS_ENV = "LLAMA_NO_EXTRA_BUFTS"


# ---- our side: locate the venv, drive a worker ---------------------------------------------------
def venv_python() -> Path | None:
    py = Path(os.environ.get("LLAMA_VENV") or HERE / ".llama-venv") / "bin" / "python"
    return py if py.exists() else None


def gguf_dir() -> Path:
    return Path(os.environ.get("GGUF_DIR") or HERE / ".gguf")


def missing_reason() -> str | None:
    """None when the venv is usable; otherwise why not, in one line."""
    py = venv_python()
    if py is None:
        return "no llama.cpp venv (run benchmarks/setup_llama_cpp.sh)"
    probe = subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"llama_cpp does not import in {py}: {probe.stderr.strip().splitlines()[-1:]}"
    return None


_PROBE = """
import sys, llama_cpp as L
L.llama_backend_init()
model = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params())
params = L.llama_context_default_params()
params.n_ctx, params.n_threads, params.n_threads_batch = 64, 1, 1
ctx = L.llama_init_from_model(model, params)
tokens = (L.llama_token * 4)(1, 2, 3, 4)
sys.exit(L.llama_decode(ctx, L.llama_batch_get_one(tokens, 4)))
"""
_repacking_crashes: bool | None = None


def repacking_crashes() -> bool:
    """Whether llama.cpp's weight repacking for this CPU crashes here, probed once a process (with
    $LLAMA_NO_EXTRA_BUFTS set, that says). On a 2-core AMX Xeon VM (2026-12-04) llama.cpp 0.3.36
    built for the CPU repacks Q4_1 and Q8_0 weights into its AMX buffer and then segfaults at the
    first decode of any model; with its extra buffer types off (`use_extra_bufts`, llama.cpp's
    `--no-repack`) it runs its AVX-512 dot products, what a user there falls back to. The workers
    then load that way, and `info["extra_bufts"]` says so."""
    global _repacking_crashes
    if _repacking_crashes is None:
        if NO_EXTRA_BUFTS_ENV in os.environ:
            _repacking_crashes = os.environ[NO_EXTRA_BUFTS_ENV] == "1"
        else:
            path = gguf_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
            py = venv_python()
            probe = subprocess.run([str(py), "-c", _PROBE, str(path)], capture_output=True, timeout=300) \
                if py is not None and path.exists() else None
            _repacking_crashes = probe is not None and probe.returncode < 0  # killed by a signal
    return _repacking_crashes


def describe() -> str:
    """The peer as the benchmarks' headers name it."""
    off = " (its weight repacking off: it segfaults on this CPU)" if venv_python() and repacking_crashes() else ""
    return f"llama-cpp-python {VERSION}{off}"


def _start_worker(py: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env[NO_EXTRA_BUFTS_ENV] = "1" if repacking_crashes() else "0"
    return subprocess.Popen([str(py), str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


class LlamaCppPeer:
    """One worker process holding one GGUF file loaded; `job(...)` returns its result dict."""

    def __init__(self, path: str | Path, threads: int, n_ctx: int, n_seq_max: int = 1) -> None:
        py = venv_python()
        if py is None:
            raise RuntimeError(missing_reason())
        self.proc = _start_worker(py)
        self.info = self.job("load", path=str(path), threads=threads, n_ctx=n_ctx, n_seq_max=n_seq_max)

    def job(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
                if "error" in result:
                    raise RuntimeError(f"llama.cpp {op}: {result['error']}")
                return result
        raise RuntimeError(f"llama.cpp worker ended during {op} (exit {self.proc.wait()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


class LlamaCppLookupPeer(LlamaCppPeer):
    """A worker holding llama-cpp-python's high-level `Llama` twice on one file: plain, and with
    prompt-lookup decoding (its draft's settings given per job)."""

    def __init__(self, path: str | Path, threads: int, n_ctx: int) -> None:
        py = venv_python()
        if py is None:
            raise RuntimeError(missing_reason())
        self.proc = _start_worker(py)
        self.info = self.job("load_lookup", path=str(path), threads=threads, n_ctx=n_ctx)


# ---- the worker, in the venv ----------------------------------------------------------------------
class Worker:
    def __init__(self) -> None:
        import llama_cpp as L
        import llama_cpp.llama_cpp as bindings

        self.L = L
        self.ctx = self.model = self.batch = None
        self.extra_bufts = os.environ.get(NO_EXTRA_BUFTS_ENV) != "1"
        if not self.extra_bufts:  # for llama-cpp-python's `Llama` too, which takes the defaults
            defaults = bindings.llama_model_default_params

            def without_extra_bufts():
                params = defaults()
                params.use_extra_bufts = False
                return params

            bindings.llama_model_default_params = L.llama_model_default_params = without_extra_bufts

    def load(self, path: str, threads: int, n_ctx: int, n_seq_max: int) -> dict:
        L = self.L
        L.llama_backend_init()
        t = time.perf_counter()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"cannot load {path}")
        params = L.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, n_seq_max, True
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("cannot make a llama.cpp context")
        self.n_batch = L.llama_n_batch(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        return {"load_s": time.perf_counter() - t, "n_batch": self.n_batch, "n_ctx": L.llama_n_ctx(self.ctx),
                "system_info": L.llama_print_system_info().decode(errors="replace"), "extra_bufts": self.extra_bufts}

    def _clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, i: int):
        import numpy as np

        return np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def _prefill(self, prompt: list[int], seq: int = 0) -> None:
        for start in range(0, len(prompt), self.n_batch):
            chunk = prompt[start:start + self.n_batch]
            last = start + len(chunk) == len(prompt)
            self._decode([(t, start + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])

    def decode(self, prompt: list[int], new_tokens: int) -> dict:
        """Greedy, one sequence: (start, first token, end) times and the tokens."""
        self._clear()
        start = time.perf_counter()
        self._prefill(prompt)
        tokens = [int(self._logits(-1).argmax())]
        first = time.perf_counter()
        while len(tokens) < new_tokens:
            self._decode([(tokens[-1], len(prompt) + len(tokens) - 1, 0, True)])
            tokens.append(int(self._logits(-1).argmax()))
        end = time.perf_counter()
        return {"ttft_s": first - start, "decode_s": end - first, "tokens": tokens}

    def throughput(self, requests: list[list]) -> dict:
        """Continuous batching over every request at once (greedy, each to its own output length)."""
        self._clear()
        prompts = [list(ids) for ids, _ in requests]
        wanted = [n for _, n in requests]
        fed = [0] * len(requests)  # prompt tokens in the KV cache
        out: list[list[int]] = [[] for _ in requests]
        start = time.perf_counter()
        while any(len(o) < n for o, n in zip(out, wanted)):
            entries, rows = [], []  # rows: (batch row whose logits give a token, its sequence)
            for s, (o, n) in enumerate(zip(out, wanted)):
                if o and len(o) < n:  # generating: its last token in
                    rows.append((len(entries), s))
                    entries.append((o[-1], len(prompts[s]) + len(o) - 1, s, True))
            for s, p in enumerate(prompts):
                room = self.n_batch - len(entries)
                if room <= 0:
                    break
                if fed[s] < len(p):
                    take = p[fed[s]:fed[s] + room]
                    done = fed[s] + len(take) == len(p)
                    entries += [(t, fed[s] + j, s, done and j == len(take) - 1) for j, t in enumerate(take)]
                    fed[s] += len(take)
                    if done:
                        rows.append((len(entries) - 1, s))
            self._decode(entries)
            for row, s in rows:
                out[s].append(int(self._logits(row).argmax()))
        elapsed = time.perf_counter() - start
        return {"elapsed_s": elapsed, "tokens": sum(len(o) for o in out)}

    def nll(self, windows: list[list[int]]) -> dict:
        """Sum of -log p(token | the window's tokens before it) over every position but each
        window's first, and how many positions that is."""
        import numpy as np

        total, count = 0.0, 0
        for window in windows:
            if len(window) > self.n_batch:
                raise RuntimeError(f"a window of {len(window)} tokens is over n_batch {self.n_batch}")
            self._clear()
            self._decode([(t, j, 0, True) for j, t in enumerate(window)])
            logits = np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(len(window), self.n_vocab))
            logits = logits[:-1].astype(np.float64)
            top = logits.max(axis=1, keepdims=True)
            logsumexp = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
            total += float((logsumexp - logits[np.arange(len(window) - 1), window[1:]]).sum())
            count += len(window) - 1
        return {"nll": total, "count": count}

    def load_lookup(self, path: str, threads: int, n_ctx: int) -> dict:
        """Two `Llama` objects on one file (llama-cpp-python's defaults but n_ctx and threads):
        plain, and with a prompt-lookup draft that records its proposals for the acceptance."""
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        proposals = self.proposals = []

        class RecordingLookup(LlamaPromptLookupDecoding):
            def __call__(self, input_ids, /, **kwargs):
                proposal = super().__call__(input_ids, **kwargs)
                proposals.append((len(input_ids), proposal.tolist()))
                return proposal

        t = time.perf_counter()
        common = dict(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.plain = Llama(**common)
        self.draft = RecordingLookup()
        # logits_all: llama-cpp-python verifies drafts from its scores array, which holds only n_batch
        # rows otherwise (a prompt longer than n_batch then fails to broadcast into it).
        self.lookup = Llama(**common, draft_model=self.draft, logits_all=True)
        return {"load_s": time.perf_counter() - t, "n_batch": self.plain.n_batch, "extra_bufts": self.extra_bufts,
                "draft_defaults": {"num_pred_tokens": LlamaPromptLookupDecoding().num_pred_tokens,
                                   "max_ngram_size": LlamaPromptLookupDecoding().max_ngram_size}}

    def lookup_generate(self, prompt: list[int], new_tokens: int, num_pred_tokens: int = 0,
                        max_ngram_size: int = 2) -> dict:
        """Greedy through `Llama.generate`, prompt lookup on when num_pred_tokens > 0: the times
        of start, first and last token, the tokens, and the drafts' proposed and accepted tokens
        (a proposal's accepted tokens: its common prefix with what greedy then produced)."""
        llama = self.lookup if num_pred_tokens else self.plain
        self.draft.num_pred_tokens, self.draft.max_ngram_size = num_pred_tokens, max_ngram_size
        self.proposals.clear()
        llama.reset()  # no KV prefix reuse from the previous job: every job prefills its prompt
        tokens: list[int] = []
        start = time.perf_counter()
        for token in llama.generate(prompt, temp=0.0):
            if not tokens:
                first = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        end = time.perf_counter()
        drafts = proposed = accepted = 0
        for seen, proposal in self.proposals:
            at = seen - len(prompt)  # the output index of the proposal's first token
            proposal = proposal[:len(tokens) - at]  # past the last output token: neither kind
            if not proposal:
                continue
            drafts += 1
            proposed += len(proposal)
            for guess, actual in zip(proposal, tokens[at:]):
                if guess != actual:
                    break
                accepted += 1
        return {"start": start, "first": first, "end": end, "tokens": tokens, "drafts": drafts,
                "proposed": proposed, "accepted": accepted}


def serve_jobs() -> None:
    worker = Worker()
    for line in sys.stdin:
        job = json.loads(line)
        op = job.pop("op")
        try:
            result = getattr(worker, op)(**job)
        except Exception as e:  # noqa: BLE001 - the error goes back to the benchmark, which names it
            result = {"error": f"{type(e).__name__}: {e}"}
        print(RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    serve_jobs()
