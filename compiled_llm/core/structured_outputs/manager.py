"""The engine core's side of structured outputs: requests wait here until their grammar is
compiled, then run with a matcher; each step's bitmask is filled here.

It exists only once a constrained request arrives: an engine that never sees one never loads
xgrammar or the tokenizer, and its steps build no bitmask.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from compiled_llm.config import ModelConfig
from compiled_llm.core.request import Request
from compiled_llm.core.structured_outputs.compiler import GrammarCompilerPool, GrammarJob
from compiled_llm.core.structured_outputs.grammar import RequestGrammar, bitmask_width, fill_grammar_bitmask
from compiled_llm.structured_output_spec import GRAMMAR_TIME_LIMIT_S, grammar_spec, xgrammar_message


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig, max_num_seqs: int) -> None:
        self.compilers = GrammarCompilerPool(model_config.tokenizer, model_config.vocab_size,
                                             model_config.eos_token_ids)
        self._waiting: dict[str, tuple[Request, GrammarJob]] = {}  # in arrival order
        self._bitmask = torch.empty((max_num_seqs, bitmask_width(model_config.vocab_size)), dtype=torch.int32)

    def add_request(self, request: Request) -> None:
        """Start (or share) the compilation of the request's grammar; it waits here until done."""
        assert request.sampling_params.structured_outputs is not None
        job = self.compilers.compile(grammar_spec(request.sampling_params.structured_outputs))
        self._waiting[request.request_id] = (request, job)

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        return [rid for rid in request_ids if self._waiting.pop(rid, None) is not None]

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready (each with its own matcher, in arrival order), and
        those whose grammar failed to compile or took longer than the time limit, with the reason."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        for rid, (request, job) in list(self._waiting.items()):
            future = job.future
            # Past the limit, done or not, it is refused: whenever the step loop happens to look.
            overran = job.seconds(now) > GRAMMAR_TIME_LIMIT_S
            if not future.done() and not overran:
                continue
            del self._waiting[rid]
            if overran:
                failed.append((request, f"The structured outputs constraint took longer than "
                                        f"{GRAMMAR_TIME_LIMIT_S:g} s to compile: it is too complex."))
                continue
            error = future.exception()
            if isinstance(error, ValueError):  # refused by validation (a peer past the frontend's)
                failed.append((request, str(error)))
            elif error is not None:
                reason = f"The structured outputs constraint failed to compile: {xgrammar_message(error)}"
                failed.append((request, reason))
            else:
                request.grammar = RequestGrammar(future.result())
                ready.append(request)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a waiting grammar is compiled, or `timeout` seconds (when nothing else runs)."""
        if self._waiting:
            wait([job.future for _, job in self._waiting.values()], timeout, return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, requests: list[Request | None], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """The step's bitmask: the rows of each constrained request that samples in it, in that
        order: one, or 1 + its drafts with speculation (None: one that finished meanwhile, which may
        sample anything; its tokens are dropped). The rows are a view of a buffer that the next
        call refills: the runner applies them first."""
        grammars = [None if r is None or r.status.finished else r.grammar for r in requests]
        num_rows = len(grammars) + sum(len(d) for d in drafts or [])
        if num_rows > self._bitmask.shape[0]:
            self._bitmask = torch.empty((num_rows, self._bitmask.shape[1]), dtype=torch.int32)
        return fill_grammar_bitmask(grammars, self._bitmask, drafts)

    def shutdown(self) -> None:
        self.compilers.shutdown()
