"""Engine-wide: whether speculating pays at the current batch size, as measured on this machine.

Verifying drafts costs compute; at batch 1 a step is bound by reading the weights and the
verification is nearly free, at larger batches it is not, and where the text does not repeat the
drafts are wasted. Per bucket of running requests (1, 2-3, 4-7, 8-15, ...) this keeps moving averages
of output tokens per second of step time for decode-only steps with speculation allowed and without
it. Until both have a few samples a bucket alternates; then it takes the better one, within a
margin in favour of plain decoding, and every `PROBE_EVERY` steps takes the other once to keep its
figure fresh. So turning speculation on costs at most those probes where it does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SAMPLES = 4  # steps of each kind before a bucket decides
PROBE_EVERY = 32  # a decided bucket tries the other choice once every this many steps
MARGIN = 0.03  # speculation must beat plain decoding by this share to be kept
_WEIGHT = 0.2  # of the latest step in a moving average


@dataclass
class _Bucket:
    steps: int = 0
    rates: tuple[float, float] = (0.0, 0.0)  # tokens/s: (plain, speculating)
    samples: tuple[int, int] = (0, 0)

    def choice(self) -> bool:
        plain, spec = self.rates
        return spec >= plain * (1 + MARGIN)


class SpeculationGain:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, num_running: int) -> _Bucket:
        return self._buckets.setdefault(max(num_running, 1).bit_length(), _Bucket())

    def speculate(self, num_running: int) -> bool:
        """Whether a step with `num_running` requests may propose drafts (called once per step)."""
        bucket = self._bucket(num_running)
        bucket.steps += 1
        if min(bucket.samples) < MIN_SAMPLES:
            return bucket.samples[1] <= bucket.samples[0]  # the kind with fewer samples
        best = bucket.choice()
        return not best if bucket.steps % PROBE_EVERY == 0 else best

    def record(self, num_running: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step's output tokens and wall time."""
        if seconds <= 0:
            return
        bucket = self._bucket(num_running)
        kind = int(speculated)
        rate = num_tokens / seconds
        rates, samples = list(bucket.rates), list(bucket.samples)
        rates[kind] = rate if samples[kind] == 0 else rates[kind] + _WEIGHT * (rate - rates[kind])
        samples[kind] += 1
        bucket.rates, bucket.samples = (rates[0], rates[1]), (samples[0], samples[1])

    def summary(self) -> dict[int, tuple[float, float, bool]]:
        """Per bucket (its largest request count): plain and speculating tokens/s, and the choice."""
        return {(1 << b) - 1: (*bucket.rates, bucket.choice())
                for b, bucket in sorted(self._buckets.items()) if min(bucket.samples) >= MIN_SAMPLES}
