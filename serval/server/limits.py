"""Per-key rate limits: token buckets on requests per minute and on tokens per minute."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    capacity: float
    tokens: float
    updated: float

    def refill(self, now: float, rate_per_s: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * rate_per_s)
        self.updated = now


class RateLimiter:
    """Admits a request when both of its key's buckets hold enough; otherwise says how long to wait."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    def acquire(self, key: str, num_tokens: int) -> float | None:
        """None when admitted (and charged); else seconds until it could be."""
        now = self.clock()
        with self._lock:
            checks = []
            if self.rpm:
                checks.append((self._bucket(key, "requests", self.rpm, now), 1.0, self.rpm / 60))
            if self.tpm:
                checks.append((self._bucket(key, "tokens", self.tpm, now), float(num_tokens), self.tpm / 60))
            wait = 0.0
            for bucket, cost, rate in checks:
                if cost > bucket.capacity:  # can never pass: a minute's worth is less than this request
                    return 60.0
                if bucket.tokens < cost:
                    wait = max(wait, (cost - bucket.tokens) / rate)
            if wait > 0:
                return max(1.0, math.ceil(wait))
            for bucket, cost, _ in checks:
                bucket.tokens -= cost
            return None

    def _bucket(self, key: str, kind: str, per_minute: int, now: float) -> _Bucket:
        bucket = self._buckets.get((key, kind))
        if bucket is None:
            bucket = self._buckets[(key, kind)] = _Bucket(per_minute, per_minute, now)
        bucket.refill(now, per_minute / 60)
        return bucket
