"""Grammars compiled once per distinct constraint, in a thread off the engine's step loop.

Compiling turns a spec into a `CompiledGrammar` for this model's vocabulary (which tokens can
follow which grammar state): milliseconds for a small schema, more for a large one, and the
vocabulary's own preparation takes a fraction of a second once. Both run in a worker thread
(xgrammar releases the GIL, so the step loop runs on); the engine keeps a request waiting until
its job is done, or refuses it once the job has run longer than the time limit. Jobs are cached by
spec, so requests with the same schema (arriving together or hours apart) share one compilation.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from compiled_llm.structured_output_spec import GrammarSpec, check_spec

if TYPE_CHECKING:
    import xgrammar as xgr

_JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(eq=False)
class GrammarJob:
    """One spec's compilation: its future, and when a worker began and ended it (monotonic)."""

    future: Future[xgr.CompiledGrammar] = field(default_factory=Future)
    started: float | None = None  # None while it queues
    ended: float | None = None

    def seconds(self, now: float) -> float:
        """How long it has run, or ran (0 while it queues)."""
        if self.started is None:
            return 0.0
        return (self.ended if self.ended is not None else now) - self.started


class GrammarCompilerPool:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_cached: int = 256) -> None:
        """`tokenizer`: a Hugging Face tokenizer, or a model folder to load one from (in the
        thread). `vocab_size`: the model's logits width, which may exceed the tokenizer's (padded
        rows are never allowed) or fall short of it (ids past it cannot be sampled)."""
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self.num_compilations = 0  # specs compiled (cache misses), for tests and stats
        self._count_lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, GrammarJob] = OrderedDict()
        # One thread: compilations queue behind each other, never behind the step loop, nor it
        # behind them. (The frontend refused what took it longer than the time limit to parse, and
        # compiling takes about as long.)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="GrammarCompiler")
        self._compiler = self._executor.submit(self._make_compiler, tokenizer, vocab_size, stop_token_ids)

    @staticmethod
    def _make_compiler(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)  # our cache is by spec

    def compile(self, spec: GrammarSpec) -> GrammarJob:
        """The compilation of `spec`, done or under way (a failed one raises from its future)."""
        job = self._cache.get(spec)
        if job is not None:
            self._cache.move_to_end(spec)
            return job
        job = GrammarJob()
        self._cache[spec] = job  # a failure is cached too: the same spec fails the same way
        self._executor.submit(self._run, spec, job)
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)  # its requests hold their own reference
        return job

    def _run(self, spec: GrammarSpec, job: GrammarJob) -> None:
        job.started = time.monotonic()
        try:
            compiled = self._compile(spec)
        except BaseException as e:  # handed to the request, as the future's exception
            job.ended = time.monotonic()
            job.future.set_exception(e)
        else:
            job.ended = time.monotonic()
            job.future.set_result(compiled)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        check_spec(spec)  # ValueError naming what xgrammar cannot parse or enforce
        compiler = self._compiler.result()
        with self._count_lock:
            self.num_compilations += 1
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == "json_object":
            return compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        return compiler.compile_grammar(spec.text)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
