"""What one request measured, and the summary of a run: throughput, latency percentiles, goodput under SLOs.

Definitions (as in vLLM's benchmark, so numbers compare):
- TTFT: request sent → first chunk with output text.
- TPOT: (E2E − TTFT) / (output tokens − 1), per request: the mean time per token after the first.
- ITL: the gaps between consecutive chunks with output text, over all requests (a chunk may carry several tokens).
- E2E: request sent → stream ended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass
class RequestResult:
    """Times in seconds. ``output_tokens`` and ``prompt_tokens`` come from the server's ``usage`` when it sent one
    (``usage_reported``), else ``output_tokens`` counts the chunks with text and ``prompt_tokens`` is 0."""

    ok: bool
    start: float = 0.0  # since the run began
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int = 0
    usage_reported: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """None for a request with fewer than two output tokens: it has no time per token after the first."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between the closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(values_s: list[float]) -> dict:
    """Mean and percentiles, in milliseconds; the values are None when there were no samples."""
    out = {"mean": 1000 * sum(values_s) / len(values_s) if values_s else None}
    for q in PERCENTILES:
        p = percentile(values_s, q)
        out[f"p{q}"] = None if p is None else 1000 * p
    return out


def parse_slos(text: str | None) -> dict[str, float]:
    """'ttft=500,tpot=100' -> {'ttft': 500.0, 'tpot': 100.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo takes NAME=MS pairs with NAME one of {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo {name}: {value!r} is not a number of milliseconds") from None
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """A failed request meets none; a request with one output token has no TPOT and cannot miss that SLO."""
    if not result.ok:
        return False
    measured = {"ttft": result.ttft, "tpot": result.tpot, "e2e": result.e2e}
    return all(measured[name] is None or 1000 * measured[name] <= limit for name, limit in slos.items())


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    """The run's report: counts, throughputs over the wall time ``duration_s``, latency distributions over the
    successful requests, and goodput: the requests meeting every SLO, as a fraction of all sent and per second."""
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok}),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "token_counts_from": ("usage" if ok and all(r.usage_reported for r in ok)
                              else "chunks" if ok and not any(r.usage_reported for r in ok) else "mixed"),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "tpot_ms": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in ok]),
    }
    if slos:
        met = sum(meets_slos(r, slos) for r in results)
        summary["goodput"] = {"slos_ms": dict(slos), "requests_met": met,
                              "fraction": met / len(results) if results else 0.0,
                              "request_rate": met / duration_s if duration_s > 0 else 0.0}
    return summary
