"""Chained block hashes for prefix caching.

A block's hash covers its parent's hash, its tokens and any extra keys, so equal hashes mean
equal whole prefixes. SHA-256 makes the hashes stable across processes and runs (Python's
`hash` is salted per process) and collisions practically impossible.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BlockHash = bytes

# The parent of every request's first block.
ROOT_HASH: BlockHash = hashlib.sha256(b"compiled-llm prefix cache v1").digest()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(extra_keys)
    return h.digest()
