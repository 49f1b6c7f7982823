"""N-gram drafts proposed in the runner, for asynchronous scheduling.

With synchronous scheduling the scheduler proposes n-gram drafts: it knows every token once a step
is accounted. With asynchronous scheduling it plans a step before the previous one's tokens are
known, so it gives each speculating request draft slots and the runner fills them here, from the
tokens it has verified by then (its rows hold them). Each request keeps an `NgramIndex` grown from
its row as tokens arrive, so a proposal costs a few lookups, as in the scheduler.
"""

from __future__ import annotations

import numpy as np

from compiled_llm.spec_decode.ngram import NgramIndex
from compiled_llm.worker.input_batch import InputBatch


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, batch: InputBatch, req_ids: list[str], rows: np.ndarray) -> np.ndarray:
        """Fill each row's draft slots (`batch.num_drafts`) with what its n-grams propose, at most as
        many; returns how many drafts each row got (its `batch.num_drafts` from now on)."""
        counts = np.zeros(len(rows), dtype=np.int64)
        for i, (rid, row) in enumerate(zip(req_ids, rows.tolist())):
            slots = int(batch.num_drafts[row])
            if not slots:
                continue
            index = self._indexes.get(rid)
            known = int(batch.num_tokens[row])
            if index is None:
                index = self._indexes[rid] = NgramIndex(self.min_n, self.max_n)
            if len(index) < known:
                index.extend(batch.token_ids[row, len(index) : known].tolist())
            drafts = index.propose(slots)
            batch.set_drafts(row, drafts)
            counts[i] = len(drafts)
        return counts

    def forget(self, req_id: str) -> None:
        """The request finished (a preempted one keeps its index: its tokens stay what they were)."""
        self._indexes.pop(req_id, None)
