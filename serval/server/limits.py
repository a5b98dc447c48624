"""Per-key rate limits: token buckets on requests per minute and on tokens per minute."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

IDLE_S = 60.0  # a bucket refills fully in a minute: one idle this long is a fresh one, and is dropped
MAX_KEYS = 10_000  # keys tracked at once; past this the least recently used key's buckets go


@dataclass
class _Bucket:
    capacity: float
    tokens: float
    updated: float

    def refill(self, now: float, rate_per_s: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * rate_per_s)
        self.updated = now


class RateLimiter:
    """Admits a request when both of its key's buckets hold enough; otherwise says how long to wait.

    The map of keys stays bounded: a key unused for IDLE_S is forgotten (its buckets would be full again), and at
    most ``max_keys`` are kept (the least recently used goes first, which only a flood of distinct keys reaches)."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS) -> None:
        self.clock = clock
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, dict[str, _Bucket]] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    @property
    def num_keys(self) -> int:
        return len(self._buckets)

    def acquire(self, key: str, num_tokens: int) -> float | None:
        """None when admitted (and charged); else seconds until it could be."""
        now = self.clock()
        with self._lock:
            self._forget_idle(now)
            buckets = self._key_buckets(key)
            checks = []
            if self.rpm:
                checks.append((self._bucket(buckets, "requests", self.rpm, now), 1.0, self.rpm / 60))
            if self.tpm:
                checks.append((self._bucket(buckets, "tokens", self.tpm, now), float(num_tokens), self.tpm / 60))
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

    def _key_buckets(self, key: str) -> dict[str, _Bucket]:
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = self._buckets[key] = {}
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return buckets

    def _forget_idle(self, now: float) -> None:
        """Drops keys unused for IDLE_S, oldest first (the map is in order of last use)."""
        while self._buckets:
            oldest = next(iter(self._buckets.values()))
            last_used = max((b.updated for b in oldest.values()), default=-math.inf)
            if now - last_used < IDLE_S:
                return
            self._buckets.popitem(last=False)

    @staticmethod
    def _bucket(buckets: dict[str, _Bucket], kind: str, per_minute: int, now: float) -> _Bucket:
        bucket = buckets.get(kind)
        if bucket is None:
            bucket = buckets[kind] = _Bucket(per_minute, per_minute, now)
        bucket.refill(now, per_minute / 60)
        return bucket
