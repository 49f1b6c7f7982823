"""What `LLM.score` and the `/score` and `/rerank` routes share: pairing the two sides, and the
score of an embed model (vLLM's: the cosine similarity of the two texts' embeddings)."""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")


def pair_up(side_1: T | list[T], side_2: T | list[T]) -> list[tuple[T, T]]:
    """One item against each of N (1:N), or item i against item i (N:N), as vLLM pairs them."""
    first = side_1 if isinstance(side_1, list) else [side_1]
    second = side_2 if isinstance(side_2, list) else [side_2]
    if not first or not second:
        raise ValueError("Scoring needs at least one text on each side.")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                         "as text_2.")
    return list(zip(first, second))


def cosine_score(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))
