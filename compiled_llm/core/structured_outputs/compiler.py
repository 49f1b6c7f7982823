"""Grammars compiled once per distinct constraint, in a thread off the engine's step loop.

Compiling turns a spec into a `CompiledGrammar` for this model's vocabulary (which tokens can
follow which grammar state): milliseconds for a small schema, more for a large one, and the
vocabulary's own preparation takes a fraction of a second once. Both run in a worker thread; the
engine keeps a request waiting until its future is done. Futures are cached by spec, so requests
with the same schema (arriving together or hours apart) share one compilation.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from compiled_llm.core.structured_outputs.spec import GrammarSpec, check_spec

if TYPE_CHECKING:
    import xgrammar as xgr

_JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarCompilerPool:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_cached: int = 256) -> None:
        """`tokenizer`: a Hugging Face tokenizer, or a model folder to load one from (in the
        thread). `vocab_size`: the model's logits width, which may exceed the tokenizer's (padded
        rows are never allowed) or fall short of it (ids past it cannot be sampled)."""
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self.num_compilations = 0  # specs compiled (cache misses), for tests and stats
        self._cache: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        # One thread: compilations queue behind each other, never behind the step loop.
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

    def compile(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, now or later (a failed compilation raises from the future)."""
        future = self._cache.get(spec)
        if future is not None:
            self._cache.move_to_end(spec)
            return future
        future = self._executor.submit(self._compile, spec)
        self._cache[spec] = future  # a failure is cached too: the same spec fails the same way
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)  # its requests hold their own reference
        return future

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        check_spec(spec)  # ValueError naming what xgrammar cannot parse or enforce
        compiler = self._compiler.result()
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
