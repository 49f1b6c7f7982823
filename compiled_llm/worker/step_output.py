"""A step's results on their way to the host.

The sampled ids (and logprobs) are copied from the device without blocking when the step is
launched; `get_output` waits for that copy only when the engine core asks for the step's
output, which under asynchronous scheduling is after the next step has been launched.
"""

from __future__ import annotations

import numpy as np
import torch

from compiled_llm.messages.runner_output import AsyncModelRunnerOutput, LogprobsLists, ModelRunnerOutput
from compiled_llm.worker.input_batch import InputBatch
from compiled_llm.worker.prompt_logprobs import PromptLogprobsTensors
from compiled_llm.worker.sampler import SamplerOutput


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class StepOutput(AsyncModelRunnerOutput):
    """`batch`: the runner's rows, which take in the sampled tokens once the host has them."""

    def __init__(
        self,
        batch: InputBatch,
        device: torch.device,
        step: int,
        req_ids: list[str],
        sample_idx: np.ndarray | None = None,
        sample_rows: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        result: SamplerOutput | None = None,
        prompt_logprobs: dict[str, PromptLogprobsTensors] | None = None,
    ) -> None:
        self.batch = batch
        self.step = step
        self.req_ids = req_ids
        self.sample_idx = sample_idx
        self.sample_rows = sample_rows
        self.positions = positions
        self._done: torch.cuda.Event | None = None
        self._host: list[torch.Tensor] = []
        # How many logprobs each sampling request wants, read now: its row may change hands later.
        self.num_logprobs = batch.sampling.num_logprobs[sample_rows].copy() if sample_rows is not None else None
        # Prompts completed in this step, for requests that asked for their logprobs.
        self._prompt_logprobs = {
            rid: PromptLogprobsTensors(_to_host(t.token_ids), _to_host(t.logprobs), _to_host(t.ranks))
            for rid, t in (prompt_logprobs or {}).items()
        }
        if result is not None:
            tensors = [result.sampled]
            if result.logprobs is not None:
                tensors += [result.logprob_token_ids, result.logprobs, result.sampled_ranks]  # type: ignore[list-item]
            self._host = [_to_host(t) for t in tensors]
        if (self._host or self._prompt_logprobs) and device.type == "cuda":
            self._done = torch.cuda.Event()  # after every copy above
            self._done.record()
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        """The step's sampled tokens and logprobs (waiting for the device if need be); also hands
        the tokens to the runner's rows, so that later steps read them from the host."""
        if self._output is not None:
            return self._output
        sampled_lists: list[list[int]] = [[] for _ in self.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if self._done is not None:
            self._done.synchronize()
        if self._host:
            assert self.sample_idx is not None and self.sample_rows is not None and self.positions is not None
            tokens = self._host[0].numpy()
            batch = self.batch
            ids = [self.req_ids[i] for i in self.sample_idx]
            # Rows still held by the same request (a preempted or finished one may have left).
            mine = np.fromiter((batch.req_ids[r] == rid for r, rid in zip(self.sample_rows, ids)), dtype=bool,
                               count=len(ids))
            batch.fill_tokens(self.sample_rows[mine], self.positions[mine], tokens[mine], self.step)
            for i, token in zip(self.sample_idx.tolist(), tokens.tolist()):
                sampled_lists[i] = [token]
            if len(self._host) > 1:
                logprobs = self._logprobs_lists(ids)
        prompt_logprobs = {rid: tensors.to_lists() for rid, tensors in self._prompt_logprobs.items()}
        self._output = ModelRunnerOutput(self.req_ids, sampled_lists, logprobs, prompt_logprobs)
        return self._output

    def _logprobs_lists(self, req_ids: list[str]) -> dict[str, LogprobsLists]:
        token_ids, lps, ranks = (t.tolist() for t in self._host[1:])
        assert self.num_logprobs is not None
        out = {}
        for i, (rid, k) in enumerate(zip(req_ids, self.num_logprobs.tolist())):
            if k >= 0:
                out[rid] = LogprobsLists([token_ids[i][: k + 1]], [lps[i][: k + 1]], [ranks[i]])
        return out


class ReadyStepOutput(AsyncModelRunnerOutput):
    """A step whose output the host already holds (a speculative verification reads its accepted
    tokens before it returns: the next step's drafts follow them)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def get_output(self) -> ModelRunnerOutput:
        return self._output
