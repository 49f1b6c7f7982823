"""The fixed workloads the benchmarks share: English-like prompts of exact token lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more can about who up what "
    "said out into time other some them could these only two may first new very then than after water people "
    "made over did down way just great through long where much little should well good year before years must "
    "world work many back life old any also most day same another know while last might us great men house "
    "city river mountain story morning evening question answer market history music science garden window"
).split()


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


def english_like_ids(tokenizer, num_tokens: int, rng: random.Random) -> list[int]:
    ids: list[int] = []
    while len(ids) < num_tokens:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))).capitalize() + ". "
        ids += tokenizer(sentence, add_special_tokens=False)["input_ids"]
    return ids[:num_tokens]


def throughput_workload(tokenizer, num_requests: int = 32, seed: int = 0,
                        prompt_range=(64, 512), output_range=(32, 256)) -> list[Request]:
    """32 requests, prompt lengths uniform in [64, 512], output lengths uniform in [32, 256]."""
    rng = random.Random(seed)
    return [
        Request(english_like_ids(tokenizer, rng.randint(*prompt_range), rng), rng.randint(*output_range))
        for _ in range(num_requests)
    ]
