"""The attention metadata of one step, built by the model runner and read by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """One flat batch of tokens, grouped by request; decode requests (one query token) come first.

    Tensors live on the model's device and may be views of persistent buffers (fixed addresses
    for CUDA graphs). The `*_cpu` arrays mirror them on the host for backends that loop in Python.
    """

    num_actual_tokens: int  # tokens before padding; rows past it have slot -1
    num_reqs: int
    num_decodes: int  # the first `num_decodes` requests have exactly one query token
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: context + query tokens of each request
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with the null block 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padded tokens
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
