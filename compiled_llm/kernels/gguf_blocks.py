"""GGUF's Q8_0, Q4_0 and Q4_1 blocks in the group-wise format the CPU kernels compute with.

A block covers 32 consecutive inputs of one row: an fp16 scale d (and, Q4_1, an fp16 min m), then
the quants: 32 int8 (Q8_0, w = d q), or 16 bytes of nibbles, input i in the low nibble of byte i
and input 16 + i in the high one (Q4_1: w = d q + m; Q4_0: w = d (q - 8) = d q + (-8 d)). Here that
becomes q [rows, cols], scales and mins [rows, cols / 32] kept in fp16, as in the file (the packed
layout keeps them so: a Q4_1 weight reads 0.625 bytes, as llama.cpp's). Q4_0's -8 d is exact in
fp16 too (a power of two), unless it overflows (|d| > 8188): such a tensor's scales and mins are
float32. Either way the de-quantized weights are bit for bit those of llama.cpp and the gguf package.
"""

from __future__ import annotations

import numpy as np
import torch

from compiled_llm.kernels.quantized_reference import QuantizedWeight

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 2 + 32, "Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16}


def _fp16(columns: np.ndarray) -> np.ndarray:
    """Two bytes per block as float16 [blocks]."""
    return np.ascontiguousarray(columns).view(np.float16)[:, 0]


def blocks_to_quantized(data: np.ndarray | bytes, kind: str, shape: tuple[int, int]) -> QuantizedWeight:
    """The raw bytes of a GGUF tensor of type `kind` ("Q8_0", "Q4_0" or "Q4_1") whose torch shape is
    `shape` = (rows, cols) (GGUF lists dimensions the other way round), as a QuantizedWeight."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"unsupported GGUF block type {kind!r}: supported are {', '.join(BLOCK_BYTES)}")
    rows, cols = shape
    if cols % BLOCK:
        raise ValueError(f"a {kind} tensor's rows hold whole blocks of {BLOCK}: {cols} columns is not a multiple")
    if isinstance(data, (bytes, bytearray)):
        raw = np.frombuffer(data, np.uint8)
    else:
        raw = np.asarray(data).reshape(-1).view(np.uint8)
    n_blocks = rows * cols // BLOCK
    if raw.size != n_blocks * BLOCK_BYTES[kind]:
        raise ValueError(f"a {kind} tensor of shape {shape} takes {n_blocks * BLOCK_BYTES[kind]} bytes, got {raw.size}")
    blocks = raw.reshape(n_blocks, BLOCK_BYTES[kind])
    d = _fp16(blocks[:, 0:2])
    groups = (rows, cols // BLOCK)
    if kind == "Q8_0":
        q = np.array(blocks[:, 2:]).view(np.int8).reshape(rows, cols)  # one copy, out of the (mapped) file
        return QuantizedWeight(torch.from_numpy(q), torch.from_numpy(d.reshape(groups)), None, 8, BLOCK)
    if kind == "Q4_1":
        mins, nibbles = _fp16(blocks[:, 2:4]), blocks[:, 4:]
    else:
        with np.errstate(over="ignore"):
            mins, nibbles = -8 * d, blocks[:, 2:]
        if not np.isfinite(mins[np.isfinite(d)]).all():  # -8 d overflows fp16: both in float32
            d, mins = d.astype(np.float32), -8 * d.astype(np.float32)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).reshape(rows, cols)
    return QuantizedWeight(torch.from_numpy(q), torch.from_numpy(d.reshape(groups)),
                           torch.from_numpy(np.ascontiguousarray(mins.reshape(groups))), 4, BLOCK)
